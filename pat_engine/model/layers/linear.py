"""Tensor-parallel linear layers. Each parameter carries its ``ShardSpec``.

Column-parallel layers split the output dim and need no communication;
row-parallel layers split the input dim and all-reduce their partial sums.
Local sizes are never cached: a layout switch replaces ``weight.data`` with a
shard of another shape and the matmul simply follows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pat_engine.model.shard_spec import Component, ShardSpec, column_bias, column_parallel, row_parallel
from pat_engine.parallel.comm import TPGroup


def sharded_parameter(spec: ShardSpec, tp: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    param = nn.Parameter(torch.zeros(spec.local_shape(tp), dtype=dtype, device=device), requires_grad=False)
    param.shard_spec = spec  # read by the loader and the resharder
    return param


class ColumnParallelLinear(nn.Module):
    """``y = x @ W_local.T (+ b_local)``: the output stays sharded across TP ranks."""

    def __init__(self, in_features: int, components: tuple[Component, ...], bias: bool, tp: int, dtype, device):
        super().__init__()
        self.weight = sharded_parameter(column_parallel(in_features, *components), tp, dtype, device)
        self.bias = sharded_parameter(column_bias(*components), tp, dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input arrives sharded; partial products are summed over the TP group."""

    def __init__(self, in_features: int, out_features: int, unit: int, tp: int, dtype, device):
        super().__init__()
        self.weight = sharded_parameter(row_parallel(out_features, in_features, unit), tp, dtype, device)

    def forward(self, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        return tp.all_reduce(F.linear(x, self.weight))
