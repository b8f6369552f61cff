"""Paged KV pool of one rank: one tensor per layer, so a switch can replace layers one by one."""

from __future__ import annotations

import mmap
import math

import torch

from pat_engine.worker.device_memory import release_cached, storage_view

# A lazy CPU layer this large is mapped from the kernel's zero pages instead of being memset: its
# pages are committed as blocks are first written, so the large default pool
# (core/memory.default_cpu_kv_bytes) costs no start-up time and no memory until it is used. A pool
# of configured size is committed up front, as the user asked for those bytes.
LAZY_ZERO_MIN_BYTES = 1 << 20


class PagedKVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype, device,
                 lazy: bool = False, scratch: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size  # the blocks the driver hands out
        self.lazy = lazy  # memory committed as blocks are written (see ``zeroed``)
        self.scratch = scratch  # one more block after them, the decode graphs' padding rows' (graph_capture.py)
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, device
        # layer l: (2, num_blocks [+ 1 scratch], block_size, kv_heads, head_dim); [0] keys, [1] values
        self.layers: list[torch.Tensor] = [self.new_layer() for _ in range(num_layers)]

    @classmethod
    def filled_later(cls, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype, device,
                     lazy: bool = False, scratch: bool = False) -> "PagedKVPool":
        """A pool with no layers yet; ``append_layer_from`` adds them one by one (a switch does, so two
        pools never hold every layer at once)."""
        return cls(0, num_blocks, block_size, kv_heads, head_dim, dtype, device, lazy, scratch)

    @property
    def scratch_block(self) -> int | None:
        """The block no sequence owns (padding rows write there), or None without one."""
        return self.num_blocks if self.scratch else None

    @property
    def layer_shape(self) -> tuple[int, ...]:
        return (2, self.num_blocks + int(self.scratch), self.block_size, self.kv_heads, self.head_dim)

    def new_layer(self) -> torch.Tensor:
        """A zeroed layer of this pool's geometry."""
        return zeroed(self.layer_shape, self.dtype, self.device, self.lazy)

    def append_layer_from(self, donor: "PagedKVPool", index: int) -> torch.Tensor:
        """Add a layer made of ``donor``'s layer ``index``, which the donor forgets.

        A layout switch keeps the per-rank byte budget (core/memory.py), so the old layer's memory fits
        the new geometry: the new layer is a view of it from its first byte, whatever part of it the old
        geometry used. That skips a free, an allocation and page faults, and keeps each layer at one
        address for the worker's life, so the decode graphs captured over a layout stay valid when the rank
        returns to it (graph_capture.py). Stale values in reused slots are never read unmasked (every slot
        is written before a query reaches it) and are finite. When it is too small (a TP below the base's
        holds larger weight shards and so smaller layers: the way back up needs more), the old layer is
        freed and handed back to the device before the new one is allocated: on a GPU whose ranks hold most
        of its memory, a second layer beside the first does not fit (a 2-layer model's layer is half the
        pool), and a freed layer kept in one rank's allocator cache starves the rank beside it (the fourth
        H100 run: one rank grew to 47 GiB while the other failed a 1.9 GiB layer).
        """
        old = donor.layers[index]
        donor.layers[index] = None
        layer = storage_view(old, self.layer_shape, self.dtype)
        if layer is None:
            del old  # the only reference
            release_cached(self.device)
            layer = self.new_layer()
        self.layers.append(layer)
        return layer

    def regeometry(self, kv_heads: int, num_blocks: int) -> "PagedKVPool":
        """The same memory seen with another number of heads per rank and blocks (contents dropped)."""
        pool = PagedKVPool.filled_later(num_blocks, self.block_size, kv_heads, self.head_dim, self.dtype, self.device,
                                        self.lazy, self.scratch)
        for index in range(len(self.layers)):  # one layer at a time, so two pools never coexist
            pool.append_layer_from(self, index)
        self.layers = []
        return pool

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers if t is not None)

    def release(self) -> None:
        self.layers = []


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, lazy: bool) -> torch.Tensor:
    """A zero tensor; ``lazy`` on the CPU, a large one is backed by an anonymous mapping that the
    kernel fills with zeros page by page on first touch (the tensor keeps the mapping alive)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not lazy or torch.device(device).type != "cpu" or nbytes < LAZY_ZERO_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
