"""The SiLU-gated MLP of a decoder layer (a dense layer's, or one routed expert's).

SiLU-mul runs as one kernel with torch's formula's bits: on a GPU the Triton kernel (``triton_ops``), on the
CPU the C++ kernel (``pat_kernels.cpu_activation``) for float32 and bfloat16; float64 keeps the formula.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pat_engine.model import cpu_gemm
from pat_engine.model.layers import triton_ops
from pat_engine.model.layers.gemm_input import GatedInput, GemmInput
from pat_engine.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.shard_spec import Component

try:  # the kernels package ships with the engine; its absence only costs speed
    from pat_kernels import cpu_activation
except ImportError:  # pragma: no cover
    cpu_activation = None


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, gate and up fused into one column-parallel product, down row-parallel."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: int, dtype, device,
                 row_chunks: int | None = None):
        super().__init__()
        inter = intermediate_size
        self.gate_up_proj = ColumnParallelLinear(hidden_size, (Component(inter), Component(inter)), False, tp, dtype,
                                                 device, row_chunks is not None)
        self.down_proj = RowParallelLinear(inter, hidden_size, 1, tp, dtype, device, row_chunks)
        self.triton = triton_ops.kernels_for(device, dtype)
        # fast-mode CPU steps run in row chunks whose gate/up output stays under glibc's mmap threshold
        self.chunked = torch.device(device).type == "cpu" and row_chunks is None

    def forward(self, x: GemmInput, tp: TPGroup) -> torch.Tensor:
        return self.down_proj.reduce(self.partial(x, tp), tp)

    def partial(self, x: GemmInput, tp: TPGroup) -> torch.Tensor:
        """This rank's share of the output before the group sums it (``RowParallelLinear.partial``)."""
        rows = x.shape[0] if isinstance(x, torch.Tensor) else x.rows
        step = cpu_gemm.mlp_chunk_rows(self.gate_up_proj.weight) if self.chunked else rows
        if rows > step:
            x = x if isinstance(x, torch.Tensor) else x.computed()
            return torch.cat([self._partial(x[i:i + step], tp) for i in range(0, rows, step)])
        return self._partial(x, tp)

    def _partial(self, x: GemmInput, tp: TPGroup) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 * inter / tp)
        return self.down_proj.partial(GatedInput(gate_up, self.triton.silu_and_mul if self.triton else silu_and_mul), tp)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, the halves of the gate/up projection's output: torch's formula, through the CPU
    kernel where it serves (the same bits in one pass)."""
    if cpu_activation is not None and cpu_activation.usable(gate_up):
        return cpu_activation.silu_mul(gate_up)
    return silu_formula(gate_up)


def silu_formula(gate_up: torch.Tensor) -> torch.Tensor:
    """torch's formula: the reference the kernels are tested against."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
