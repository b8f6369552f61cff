"""How many KV blocks each rank holds under a layout.

On CPU the KV budget per rank is configured (default 64 MiB). On GPU each
worker measures what is left after loading its weights; the ranks agree on
the minimum. A layout with smaller TP holds bigger weight shards, so its KV
budget shrinks by the difference; fewer KV heads per rank make each block
smaller, so a higher TP fits more blocks in the same bytes.
"""

from __future__ import annotations

import torch

from pat_engine.model.arch import ModelArch
from pat_engine.parallel.layout import Layout
from pat_engine.worker.kv_pool import PagedKVPool

CPU_DEFAULT_KV_BYTES = 64 << 20


def weight_bytes_per_rank(arch: ModelArch, tp: int, dtype: torch.dtype) -> int:
    """Bytes of one rank's weight shard (vocab padding and KV-head replication included)."""
    elt = torch.empty((), dtype=dtype).element_size()
    h, hd = arch.hidden_size, arch.head_dim
    q = arch.num_heads // tp * hd
    kv = arch.kv_heads_per_rank(tp) * hd
    inter = arch.intermediate_size // tp
    vocab = -(-arch.vocab_size // tp)
    per_layer = h * (q + 2 * kv) + q * h + 2 * inter * h + inter * h + 2 * h
    if arch.qkv_bias:
        per_layer += q + 2 * kv
    if arch.qk_norm:
        per_layer += 2 * hd
    heads = vocab * h * (1 if arch.tie_word_embeddings else 2)
    return elt * (arch.num_layers * per_layer + heads + h)


class MemoryPlan:
    def __init__(self, arch: ModelArch, dtype: torch.dtype, block_size: int, kv_budget_bytes: int, base: Layout,
                 device_budget: bool):
        self.arch, self.dtype, self.block_size = arch, dtype, block_size
        self.kv_budget_base = kv_budget_bytes
        self.base = base
        self.device_budget = device_budget  # True: weights and KV share one memory budget (GPU)

    def kv_budget(self, layout: Layout) -> int:
        if not self.device_budget:
            return self.kv_budget_base
        delta = weight_bytes_per_rank(self.arch, self.base.tp, self.dtype) - weight_bytes_per_rank(self.arch, layout.tp, self.dtype)
        return max(0, self.kv_budget_base + delta)

    def block_bytes(self, layout: Layout) -> int:
        return PagedKVPool.block_bytes(self.arch.num_layers, self.block_size, self.arch.kv_heads_per_rank(layout.tp),
                                       self.arch.head_dim, self.dtype)

    def num_blocks(self, layout: Layout) -> int:
        return self.kv_budget(layout) // self.block_bytes(layout)

    def tokens_per_group(self, layout: Layout) -> int:
        return self.num_blocks(layout) * self.block_size
