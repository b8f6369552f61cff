"""Memory a model shard takes, read off the same shard specs the loader and the resharder use."""

from __future__ import annotations

import functools
import math

import torch

from pat_engine.model.arch import ModelArch
from pat_engine.model.chunk_weights import accumulate_dtype
from pat_engine.model.layers.linear import RowParallelLinear
from pat_engine.model.llama import CausalLM


@functools.lru_cache(maxsize=64)
def weight_bytes_per_rank(arch: ModelArch, tp: int, dtype: torch.dtype) -> int:
    """Bytes of one rank's weight shard under TP ``tp`` (vocab padding and KV-head replication
    included; a tied LM head counted once), from a shape-only model."""
    model = CausalLM(arch, tp, dtype, "meta")
    return sum(math.prod(p.shard_spec.local_shape(tp)) * dtype.itemsize for p in model.parameters())


@functools.lru_cache(maxsize=64)
def derived_bytes_per_rank(arch: ModelArch, tp: int, dtype: torch.dtype, numerics: str, world: int) -> int:
    """Device bytes one rank holds beside its weight shard, derived from it: in the invariant numerics
    mode the row-parallel weights' chunk pieces (model/chunk_weights.py), a copy of the local shard in
    the accumulation dtype (2x the bytes of a bfloat16 shard), except where a rank's one chunk in the
    model's own dtype is the shard itself. The CPU GEMM packs are not counted: only a device budget
    (GPU) is planned from weight bytes."""
    if numerics != "invariant":
        return 0
    acc = accumulate_dtype(dtype)
    if acc == dtype and arch.max_tp(world) == tp:  # one whole chunk per rank: no copy is made
        return 0
    model = CausalLM(arch, tp, dtype, "meta")
    rows = [m.weight for m in model.modules() if isinstance(m, RowParallelLinear)]
    return sum(math.prod(w.shard_spec.local_shape(tp)) for w in rows) * acc.itemsize


def device_bytes_per_rank(arch: ModelArch, tp: int, dtype: torch.dtype, numerics: str = "fast", world: int = 1) -> int:
    """Weights plus their derived copies: what a layout's weights take from one rank's device memory."""
    return weight_bytes_per_rank(arch, tp, dtype) + derived_bytes_per_rank(arch, tp, dtype, numerics, world)
