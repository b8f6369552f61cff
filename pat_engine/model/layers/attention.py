"""Paged attention over a per-layer KV pool: plain torch for prefill, kernels for decode.

KV pool of one layer: ``(2, num_blocks, block_size, kv_heads_local, head_dim)``;
a token at position ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

Decode (one query per row, ``context_lens`` set) reads the pool in place:
on CUDA the Triton kernel (``pat_kernels/paged_decode_attention.py``), on the CPU the C++ kernel
(``pat_kernels/cpu/paged_decode_attention.cpp``, float32/float64/bfloat16, built on first use and
cached; ``PAT_CPU_ATTENTION=torch`` turns it off). Otherwise, and for prefill, the torch path
gathers whole context blocks and runs ``scaled_dot_product_attention`` with the step's mask.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    from pat_kernels.cpu_attention import cpu_decode_kernel
    from pat_kernels.cpu_attention import write_kv as cpu_write_kv
except ImportError as missing:  # the kernels package is not on the path: the torch paths serve
    _KERNELS_MISSING: str | None = str(missing)

    def cpu_decode_kernel(dtype: torch.dtype) -> None:
        return None

    cpu_write_kv = None
else:
    _KERNELS_MISSING = None

log = logging.getLogger(__name__)


def load_decode_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """Build or load the CPU kernels now (worker start-up) rather than in the first decode step,
    which would stall that DP group mid-batch (about 15 s on a cold cache, 0.2-1 s warm).
    Returns whether the decode kernel serves this device and dtype."""
    if device.type != "cpu":
        return False
    if _KERNELS_MISSING is not None:  # said once per worker: every CPU kernel is off, silently slower otherwise
        log.warning("pat_kernels cannot be imported (%s): the CPU kernels are off and the torch paths run; "
                    "install pat-engine (pip install -e .) or put csrc/ on PYTHONPATH", _KERNELS_MISSING)
        return False
    return cpu_decode_kernel(dtype) is not None


@dataclass
class AttentionMetadata:
    """Per-step batch geometry, built once (worker/step_inputs.py) and shared by every layer.

    Every sequence of the step is one row of a padded batch: ``query_len`` query slots
    (1 in decode) over its context, which is read from the pool through ``block_tables``
    (B, blocks); ``mask`` (B, 1, query_len, blocks * block_size) says which context
    tokens each query sees (causal, and only the row's own tokens). Prefill packs its T
    new tokens; ``pad_index`` (T,) places each in the padded (B * query_len) layout.
    Gathering whole blocks copies contiguous runs of ``block_size`` tokens, several
    times faster on CPU than gathering token by token.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # (N,) slot of each new token; N may be below the rows (decode padding)
    query_len: int
    block_tables: torch.Tensor
    mask: torch.Tensor
    pad_index: torch.Tensor | None = None  # prefill only
    context_lens: torch.Tensor | None = None  # (B,) decode: for the paged decode kernels


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
    """Store the new tokens' K/V; k, v: (T, kvh, hd), of which the first ``len(slots)`` are real."""
    if kv_cache.device.type == "cpu" and cpu_write_kv is not None and cpu_write_kv(kv_cache, k, v, slots):
        return
    kvh, hd = kv_cache.shape[-2:]
    n = slots.shape[0]
    kv_cache[0].view(-1, kvh, hd).index_copy_(0, slots, k[:n])
    kv_cache[1].view(-1, kvh, hd).index_copy_(0, slots, v[:n])


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q: (T, h, hd); k, v: (T, kvh, hd) for the new tokens. Returns (T, h, hd).

    One attention call for the whole batch, prefill and decode alike (no loop over sequences).
    """
    write_kv(kv_cache, k, v, meta.slot_mapping)
    kvh, hd = kv_cache.shape[-2:]
    if not meta.is_prefill and meta.context_lens is not None:
        if q.is_cuda:
            kernel = _triton_decode() if q.dtype != torch.float64 else None
            if kernel is not None:
                return kernel(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.context_lens, scale)
        elif q.device.type == "cpu":
            kernel = cpu_decode_kernel(q.dtype)
            if kernel is not None and kv_cache.is_contiguous():  # it indexes the pool by offsets
                return kernel(q, kv_cache, meta.block_tables, meta.context_lens, scale)
    b, nb = meta.block_tables.shape
    # index_select over whole blocks (contiguous rows) is several times faster than advanced indexing
    blocks = kv_cache.view(2, kv_cache.shape[1], -1).index_select(1, meta.block_tables.reshape(-1))
    kv = blocks.view(2, b, -1, kvh, hd).transpose(2, 3)  # (2, B, kvh, nb*bs, hd)
    n, heads = meta.query_len, q.shape[1]
    if meta.pad_index is None:  # decode: one query per row, already in batch order
        qb = q.view(b, n, heads, hd)
    else:
        qb = q.new_zeros(b * n, heads, hd).index_copy_(0, meta.pad_index, q).view(b, n, heads, hd)
    out = F.scaled_dot_product_attention(
        qb.transpose(1, 2), kv[0], kv[1], attn_mask=meta.mask, scale=scale, enable_gqa=True
    )  # (B, h, n, hd)
    out = out.transpose(1, 2).reshape(b * n, heads, hd)
    return out if meta.pad_index is None else out.index_select(0, meta.pad_index)
