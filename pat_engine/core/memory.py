"""How many KV blocks each rank holds under a layout, and whether a request fits a DP group.

On CPU the KV budget per rank is configured, or by default a share of the memory available at
start-up (``default_cpu_kv_bytes``, as vLLM's CPU build sizes its pool). On GPU each
worker measures what is left after loading its weights; the ranks agree on
the minimum. A switch writes each weight shard into its parameter's storage when it fits there
(worker/switch_executor.py), so a layout with a higher TP than the base's keeps the base's weight
bytes and the base's KV bytes; one with a lower TP holds bigger shards, so its KV budget shrinks by the
difference (model/footprint.py). Fewer KV heads per rank make each block smaller, so a higher TP fits
more blocks in the same bytes. Equal bytes keep every KV layer and weight at one address across switches
to higher TPs and back, so the decode graphs of a layout survive its leaving (worker/graph_capture.py).
"""

from __future__ import annotations

import os

import torch

from pat_engine.core.block_pool import blocks_needed
from pat_engine.model.arch import ModelArch
from pat_engine.model.footprint import weight_bytes_per_rank
from pat_engine.parallel.layout import Layout

CPU_KV_MEMORY_FRACTION = 0.25  # of the memory available at start-up, shared by the world's ranks
CPU_MIN_KV_BYTES = 64 << 20  # the floor on a machine with little memory free


def default_cpu_kv_bytes(arch: ModelArch, dtype: torch.dtype, block_size: int, layout: Layout, max_num_seqs: int,
                         max_len: int) -> int:
    """The KV bytes per rank when none are configured on CPU.

    A share of the memory available now, but no more than a DP group can use: ``max_num_seqs``
    requests at ``max_len`` tokens. A fixed small pool would cap the batch instead (the old 64 MiB
    held 8192 tokens of an 8 KB/token model, so a batch of 64 requests of 160 tokens ran in two
    waves). The pool's pages are committed only as blocks are written (worker/kv_pool.zeroed).
    """
    share = int(available_memory_bytes() * CPU_KV_MEMORY_FRACTION) // layout.world
    usable = max_num_seqs * kv_slots(max_len, block_size) * arch.kv_bytes_per_token(layout.tp, dtype)
    return max(CPU_MIN_KV_BYTES, min(share, usable))


def kv_slots(tokens: int, block_size: int) -> int:
    """KV token slots that ``tokens`` occupy: whole blocks (the one home of this rule)."""
    return blocks_needed(tokens, block_size) * block_size


def available_memory_bytes() -> int:
    """Memory the kernel can give without swapping (MemAvailable), or free pages off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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
        grown = (weight_bytes_per_rank(self.arch, layout.tp, self.dtype)
                 - weight_bytes_per_rank(self.arch, self.base.tp, self.dtype))
        return max(0, self.kv_budget_base - max(0, grown))  # smaller shards keep the base's storage

    def block_bytes(self, layout: Layout) -> int:
        return self.block_size * self.arch.kv_bytes_per_token(layout.tp, self.dtype)

    def num_blocks(self, layout: Layout) -> int:
        return self.kv_budget(layout) // self.block_bytes(layout)

    def tokens_per_group(self, layout: Layout) -> int:
        return self.num_blocks(layout) * self.block_size

    def slots_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """KV token slots a request can grow to: its prompt plus every token it may generate, in whole blocks."""
        return kv_slots(prompt_len + max_new_tokens, self.block_size)

    def fits(self, layout: Layout, prompt_len: int, max_new_tokens: int) -> bool:
        """Whether one DP group of ``layout`` can hold the request at its longest (the one home of this rule)."""
        return self.slots_needed(prompt_len, max_new_tokens) <= self.tokens_per_group(layout)
