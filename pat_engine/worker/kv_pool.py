"""Paged KV pool of one rank: one tensor per layer, so a switch can replace layers one by one."""

from __future__ import annotations

import torch


class PagedKVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype, device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, device
        # layer l: (2, num_blocks, block_size, kv_heads, head_dim); [0] keys, [1] values
        self.layers: list[torch.Tensor] = [self.new_layer() for _ in range(num_layers)]

    def new_layer(self) -> torch.Tensor:
        return torch.zeros(2, self.num_blocks, self.block_size, self.kv_heads, self.head_dim, dtype=self.dtype, device=self.device)

    @staticmethod
    def block_bytes(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    def release(self) -> None:
        self.layers = []
