"""Paged attention over a per-layer KV pool, in plain torch (CPU and GPU).

KV pool of one layer: ``(2, num_blocks, block_size, kv_heads_local, head_dim)``;
a token at position ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step batch geometry, built once and shared by every layer.

    Prefill: ``query_starts`` (B+1 offsets into the T new tokens) and, for each
    sequence, its start position; ``context_slots[i]`` is set only when a
    sequence already has cached tokens (then the whole context is gathered).
    Decode: one query per sequence; ``block_tables`` (B, max_blocks) and
    ``decode_mask`` (B, 1, 1, max_blocks * block_size) cover each padded context.
    Gathering whole blocks copies contiguous runs of ``block_size`` tokens,
    several times faster on CPU than gathering token by token.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # (T,) slot of each new token
    query_starts: list[int] | None = None
    start_positions: list[int] | None = None
    context_slots: list[torch.Tensor | None] | None = None
    block_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None  # (B,) for the GPU decode kernel


_TRITON_DECODE: object = None  # the Triton kernel, False when unavailable, None before the first look


def _triton_decode():
    """The Triton paged decode kernel on a CUDA machine with Triton, else None."""
    global _TRITON_DECODE
    if _TRITON_DECODE is None:
        try:
            from pat_kernels.paged_decode_attention import paged_decode_attention

            _TRITON_DECODE = paged_decode_attention
        except Exception:  # Triton missing or unusable: the torch path serves
            _TRITON_DECODE = False
    return _TRITON_DECODE or None


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store the new tokens' K/V; k, v: (T, kvh, hd)."""
    kvh, hd = kv_cache.shape[-2:]
    kv_cache[0].view(-1, kvh, hd).index_copy_(0, slots, k)
    kv_cache[1].view(-1, kvh, hd).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q: (T, h, hd); k, v: (T, kvh, hd) for the new tokens. Returns (T, h, hd)."""
    write_kv(kv_cache, k, v, meta.slot_mapping)
    kvh, hd = kv_cache.shape[-2:]
    if not meta.is_prefill:
        kernel = _triton_decode() if q.is_cuda and q.dtype != torch.float64 else None
        if kernel is not None and meta.context_lens is not None:
            return kernel(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.context_lens, scale)
        b, nb = meta.block_tables.shape
        # index_select over whole blocks (contiguous rows) is several times faster than advanced indexing
        blocks = kv_cache.view(2, kv_cache.shape[1], -1).index_select(1, meta.block_tables.reshape(-1))
        kv = blocks.view(2, b, -1, kvh, hd).transpose(2, 3)  # (2, B, kvh, nb*bs, hd)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), kv[0], kv[1], attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )  # (B, h, 1, hd)
        return out.squeeze(2)
    outputs = []
    starts = meta.query_starts
    for i in range(len(starts) - 1):
        qi = q[starts[i] : starts[i + 1]].transpose(0, 1)  # (h, n, hd)
        slots = meta.context_slots[i] if meta.context_slots else None
        if slots is None:  # nothing cached before: attend to the new tokens only, causally
            ki, vi = k[starts[i] : starts[i + 1]].transpose(0, 1), v[starts[i] : starts[i + 1]].transpose(0, 1)
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            ki = kv_cache[0].view(-1, kvh, hd)[slots].transpose(0, 1)  # (kvh, ctx, hd)
            vi = kv_cache[1].view(-1, kvh, hd)[slots].transpose(0, 1)
            n, start = qi.shape[1], meta.start_positions[i]
            mask = torch.arange(slots.numel(), device=q.device)[None, :] <= (start + torch.arange(n, device=q.device))[:, None]
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
        outputs.append(oi.transpose(0, 1))
    return torch.cat(outputs, dim=0)
