"""Tensor-parallel linear layers. Each parameter carries its ``ShardSpec``.

Column-parallel layers split the output dim and need no communication;
row-parallel layers split the input dim and all-reduce their partial sums, or, in the
invariant numerics mode, sum fixed chunks of it by one tree whatever the TP (docs/numerics.md).
Local sizes are never cached: a layout switch replaces ``weight.data`` with a
shard of another shape and the matmul simply follows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pat_engine.model import chunk_weights, cpu_gemm, gpu_gemm
from pat_engine.model.layers import triton_ops
from pat_engine.model.layers.gemm_input import GemmInput
from pat_engine.parallel.shard_spec import Component, ShardSpec, column_bias, column_parallel, row_parallel
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.reduction_tree import ReductionTree


def linear(x: GemmInput, weight: torch.Tensor, bias: torch.Tensor | None = None,
           invariant: bool = False, skinny_rows: int = 0, prologue_rows: int = 0) -> torch.Tensor:
    """``x @ weight.T (+ bias)``, the one GEMM entry of the layers. ``invariant`` (the invariant numerics
    mode): one reduction order per output element whatever the row count, the padding or the other
    rows (docs/numerics.md): on CUDA the fixed-tiling Triton GEMM (model/gpu_gemm.py), on the CPU
    oneDNN / torch with ``cpu_gemm.padded_rows``'s row floor. ``skinny_rows`` (a fast-mode layer's
    ``gpu_gemm.skinny_rows``): steps of 1 to that many rows go through the skinny Triton GEMM. CPU GEMMs
    go through the weight's oneDNN pack when it has one (model/cpu_gemm.py). ``x`` may be an input still to
    compute (layers/gemm_input.py): steps of 1 to ``prologue_rows`` rows (``gpu_gemm.prologue_rows``) compute
    it in the skinny GEMM's prologue, the others first compute it as the layer did."""
    if not isinstance(x, torch.Tensor):
        if 0 < x.rows <= min(prologue_rows, skinny_rows):
            return x.matmul(weight, bias)
        x = x.computed()
    if skinny_rows and x.dim() == 2 and 0 < x.shape[0] <= skinny_rows:
        return gpu_gemm.skinny_matmul(x, weight, bias)
    if x.device.type == "cpu" and x.dim() == 2:
        return cpu_gemm.linear(x, weight, bias, invariant)
    if invariant and gpu_gemm.covers(x):
        return gpu_gemm.invariant_matmul(x, weight, bias)
    return F.linear(x, weight, bias)


def sharded_parameter(spec: ShardSpec, tp: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(spec.local_shape(tp), dtype=dtype, device=device), requires_grad=False)
    param.shard_spec = spec  # read by the loader and the resharder
    return param


class ColumnParallelLinear(nn.Module):
    """``y = x @ W_local.T (+ b_local)``: the output stays sharded across TP ranks."""

    is_gemm_weight = True  # packed for the CPU GEMM (model/cpu_gemm.py)

    def __init__(self, in_features: int, components: tuple[Component, ...], bias: bool, tp: int, dtype, device,
                 invariant: bool = False):
        super().__init__()
        self.weight = sharded_parameter(column_parallel(in_features, *components), tp, dtype, device)
        self.bias = sharded_parameter(column_bias(*components), tp, dtype, device) if bias else None
        self.invariant = invariant  # the invariant numerics mode's GEMM (``linear``)
        self.skinny_rows = 0 if invariant else gpu_gemm.skinny_rows(device, dtype)  # few-row steps' GEMM
        self.prologue_rows = gpu_gemm.prologue_rows(self.skinny_rows, triton_ops.serves(device, dtype))

    def forward(self, x: GemmInput) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.invariant, self.skinny_rows, self.prologue_rows)


class RowParallelLinear(nn.Module):
    """Input arrives sharded; partial products are summed over the TP group.

    ``chunks`` (the invariant numerics mode): the input dim is cut into that many fixed pieces,
    each multiplied on its own with float32 accumulation (float64 for float64; model/chunk_weights.py)
    and summed by one ``ReductionTree``, then rounded to the model dtype once; None: one GEMM and
    the group's all-reduce (faster, but the layout decides the rounding)."""

    def __init__(self, in_features: int, out_features: int, unit: int, tp: int, dtype, device,
                 chunks: int | None = None):
        super().__init__()
        self.weight = sharded_parameter(row_parallel(out_features, in_features, unit), tp, dtype, device)
        self.tree = ReductionTree(chunks) if chunks else None
        if chunks and (in_features % chunks or chunks & (chunks - 1)):
            raise ValueError(f"invariant numerics: {chunks} chunks (the declared reduction width) must be a power "
                             f"of two dividing the row-parallel input dim {in_features}")
        self.chunk_width = in_features // chunks if chunks else 0
        self.is_gemm_weight = chunks is None  # the invariant path multiplies its chunk pieces instead
        self.skinny_rows = 0 if chunks else gpu_gemm.skinny_rows(device, dtype)  # few-row steps' GEMM
        self.prologue_rows = gpu_gemm.prologue_rows(self.skinny_rows, triton_ops.serves(device, dtype))

    def forward(self, x: GemmInput, tp: TPGroup) -> torch.Tensor:
        return self.reduce(self.partial(x, tp), tp)

    def partial(self, x: GemmInput, tp: TPGroup) -> torch.Tensor:
        """``(M, out)``: this rank's share of the product before the group sums it: its local product in the
        model's dtype, or (invariant) its node of the tree in the accumulation dtype. Routed experts
        (layers/moe.py) weigh and combine these before one sum over the group."""
        if self.tree is None:
            return linear(x, self.weight, skinny_rows=self.skinny_rows, prologue_rows=self.prologue_rows)
        if not isinstance(x, torch.Tensor):
            x = x.computed()
        first = tp.rank * self.tree.local_chunks(tp.size)
        return chunk_weights.local_sum(x, self.weight, self.chunk_width, self.tree, first)

    def reduce(self, partial: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        """The group's sum of ``partial`` (any leading shape) in the model's dtype: an all-reduce, or
        (invariant) the tree's root rounded once."""
        if self.tree is None:
            return tp.all_reduce(partial)
        return self.tree.reduce(partial, tp).to(self.weight.dtype)
