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

from pat_engine.model import chunk_weights, cpu_gemm
from pat_engine.parallel.shard_spec import Component, ShardSpec, column_bias, column_parallel, row_parallel
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.reduction_tree import ReductionTree


# torch's CPU GEMM runs row counts that are not a multiple of 4 through a slower remainder path
# (float64, 2048x6144 weight, one thread: 7 rows take 21 ms, 8 rows 10 ms). Decode batches have
# arbitrary sizes, so zero rows are added up to the next multiple; beyond a few hundred rows the
# remainder no longer matters. Each output row depends only on its own input row.
_CPU_ROW_ALIGN = 4
_CPU_PAD_BELOW = 256


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through the weight's oneDNN pack when it has one (model/cpu_gemm.py), else with
    CPU row padding (see above)."""
    out = cpu_gemm.packed_linear(x, weight, bias)
    if out is not None:
        return out
    rows = x.shape[0]
    if x.device.type != "cpu" or x.dim() != 2 or rows < 3 or rows % _CPU_ROW_ALIGN == 0 or rows >= _CPU_PAD_BELOW:
        return F.linear(x, weight, bias)
    padded = F.pad(x, (0, 0, 0, _CPU_ROW_ALIGN - rows % _CPU_ROW_ALIGN))
    return F.linear(padded, weight, bias)[:rows]


def sharded_parameter(spec: ShardSpec, tp: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(spec.local_shape(tp), dtype=dtype, device=device), requires_grad=False)
    param.shard_spec = spec  # read by the loader and the resharder
    return param


class ColumnParallelLinear(nn.Module):
    """``y = x @ W_local.T (+ b_local)``: the output stays sharded across TP ranks."""

    is_gemm_weight = True  # packed for the CPU GEMM (model/cpu_gemm.py)

    def __init__(self, in_features: int, components: tuple[Component, ...], bias: bool, tp: int, dtype, device):
        super().__init__()
        self.weight = sharded_parameter(column_parallel(in_features, *components), tp, dtype, device)
        self.bias = sharded_parameter(column_bias(*components), tp, dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input arrives sharded; partial products are summed over the TP group.

    ``chunks`` (the invariant numerics mode): the input dim is cut into that many fixed pieces,
    each multiplied on its own in float32 (float64 for float64) and summed by one
    ``ReductionTree``, then rounded to the model dtype once; None: one GEMM and the group's
    all-reduce (faster, but the layout decides the rounding)."""

    def __init__(self, in_features: int, out_features: int, unit: int, tp: int, dtype, device,
                 chunks: int | None = None):
        super().__init__()
        self.weight = sharded_parameter(row_parallel(out_features, in_features, unit), tp, dtype, device)
        self.tree = ReductionTree(chunks) if chunks else None
        if chunks and in_features % chunks:
            raise ValueError(f"invariant numerics: the {chunks} chunks (the largest TP) do not divide the "
                             f"row-parallel input dim {in_features}")
        self.chunk_width = in_features // chunks if chunks else 0
        self.is_gemm_weight = chunks is None  # the invariant path multiplies its chunk pieces instead

    def forward(self, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        if self.tree is None:
            return tp.all_reduce(linear(x, self.weight))
        w = self.chunk_width
        pieces = chunk_weights.pieces(self.weight, w)
        acc = chunk_weights.accumulate_dtype(x.dtype)
        chunks = x.reshape(x.shape[0], len(pieces), w).transpose(0, 1).to(acc).contiguous()  # (n, M, w)
        partials = [linear(chunk, piece) for chunk, piece in zip(chunks, pieces)]  # n x (M, out)
        return self.tree.reduce(partials, tp).to(x.dtype)
