"""Memory a model shard takes, read off the same shard specs the loader and the resharder use."""

from __future__ import annotations

import functools
import math

import torch

from pat_engine.model.arch import ModelArch
from pat_engine.model.llama import CausalLM


@functools.lru_cache(maxsize=64)
def weight_bytes_per_rank(arch: ModelArch, tp: int, dtype: torch.dtype) -> int:
    """Bytes of one rank's weight shard under TP ``tp`` (vocab padding and KV-head replication
    included; a tied LM head counted once), from a shape-only model. What a GPU rank holds of the
    model: nothing is derived from it there (the invariant mode's GEMM reads the weights in place,
    model/chunk_weights.py); the CPU's packs and pieces are not planned (the KV budget is set apart)."""
    model = CausalLM(arch, tp, dtype, "meta")
    return sum(math.prod(p.shard_spec.local_shape(tp)) * dtype.itemsize for p in model.parameters())
