"""``TritonAttention``: the Triton kernels of ``pat_kernels`` behind the ``AttentionBackend`` protocol.

- decode: the one-program-per-(sequence, head) kernel, or the split-KV kernel when
  ``decode_splits`` says so (the long tail of a rollout: few sequences, long contexts);
- prefill (``numerics="fast"``): the packed varlen kernel, no padding to the longest prompt;
- ``numerics="invariant"``: every decode through the split-KV kernel with one fixed split size,
  and prefill through that same decode path, one query row per token (as ``prefill_as_decode``
  gives the torch backend), so prefilled KV equals decoded KV and nothing depends on the batch
  or on the heads a rank holds (docs/attention.md).

Nothing here imports Triton at module import: the kernels load on first use, so the backend
can be registered (``attention.py``) on machines without Triton. Tensors on the CPU run the
kernels only under ``TRITON_INTERPRET=1`` (the tests); otherwise the torch path serves them.
"""

from __future__ import annotations

import logging
import os

import torch

from pat_engine.model.layers.attention import AttentionBackend, AttentionMetadata, TorchAttention, gather_attention

log = logging.getLogger(__name__)

NUMERICS = ("fast", "invariant")  # as pat_engine.config.NUMERICS
INVARIANT_TOKENS_PER_SPLIT = 256  # one split size for every decode of the invariant mode
MIN_TOKENS_PER_SPLIT = 256  # fast mode: the partial (D + 2 floats) is < 1% of the bytes its split reads
PROGRAMS_PER_SM = 4  # fast mode: below this many (seq, head) programs per SM the one-program grid leaves bandwidth idle
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # float64 keeps the torch path


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def decode_splits(batch: int, heads: int, max_context: int, sm_count: int, numerics: str, block_size: int = 16,
                  invariant_tokens_per_split: int = INVARIANT_TOKENS_PER_SPLIT) -> int | None:
    """How a decode step's attention is cut: tokens per split, or None for one program per (sequence, head).

    Args:
        batch: rows of the step (padding rows included). heads: query heads on this rank.
        max_context: an upper bound of the longest context (the block table's width in tokens).
        sm_count: the GPU's streaming multiprocessors. numerics: "fast" or "invariant".
        block_size: the KV page size; a split is a whole number of pages.
        invariant_tokens_per_split: the invariant mode's constant (tests shrink it).
    Returns:
        A multiple of ``block_size``, or None.

    **fast**: split only when the step is the tail, ``batch * heads < PROGRAMS_PER_SM * sm_count``
    (the one-program grid cannot fill the GPU), into enough splits to reach that many programs,
    but none shorter than ``MIN_TOKENS_PER_SPLIT`` tokens, so the float32 partials and the reduce
    stay a small fraction of the KV bytes read; fewer than 2 splits: None. The decision depends
    on the batch, so a sequence's bits here depend on what it is batched with (as in any engine
    that picks its split count per step).

    **invariant**: always ``invariant_tokens_per_split`` rounded up to the page size, whatever the
    batch, heads or context. The split kernel computes each (sequence, head) from its own splits
    of that fixed size, merged in split order, so its result is a function of the sequence alone
    (query, length, KV), never of the batch size, the batch's longest context, the padding or the
    heads per rank (TP changes the heads per rank, and each head is its own program). Choosing
    the split count per step, or switching between the two kernels by batch size, would change
    the order of the sum, and so the bits, whenever the batch or TP changed. A short sequence
    has one split (the same result as one program); the fixed cost is one partial write and one
    reduce launch per layer, against a tail that now runs ``ceil(context / 256)`` programs per head.
    """
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    if numerics == "invariant":
        return _round_up(max(invariant_tokens_per_split, block_size), block_size)
    target = PROGRAMS_PER_SM * sm_count
    programs = batch * heads
    if programs == 0 or programs >= target:
        return None
    splits = min(-(-target // programs), max_context // MIN_TOKENS_PER_SPLIT)
    if splits < 2:
        return None
    return _round_up(-(-max_context // splits), block_size)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonAttention(AttentionBackend):
    """Paged attention through the Triton kernels (decode: one-program or split-KV; prefill: varlen)."""

    name = "triton"

    def __init__(self, numerics: str = "fast", sm_count: int | None = None,
                 invariant_tokens_per_split: int = INVARIANT_TOKENS_PER_SPLIT,
                 prefill_tiles: tuple[int, int] = (64, 64)):
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
        try:
            import triton  # noqa: F401  (present, not yet used: the kernels load on first use)
        except ImportError as missing:
            raise ImportError(f'the "triton" attention backend needs Triton ({missing}): pip install -e ".[gpu]"') from None
        self.numerics = numerics
        self.sm_count = sm_count  # read from the device at load() when None
        self.invariant_tokens_per_split = invariant_tokens_per_split
        self.prefill_tiles = prefill_tiles  # (BLOCK_M, BLOCK_N) of the varlen kernel
        self._torch = TorchAttention()  # the KV write and the float64 / no-kernel paths

    def load(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether the Triton kernels serve this device and dtype (CUDA, or CPU under the interpreter)."""
        if dtype not in _KERNEL_DTYPES or not (device.type == "cuda" or _interpreting()):
            self._torch.load(device, dtype)
            return False
        if device.type == "cuda" and self.sm_count is None:
            self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        _kernels()  # import (and fail) now, not mid-step
        return True

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self._torch.write_kv(kv_cache, k, v, slots)

    def _serves(self, q: torch.Tensor) -> bool:
        return q.dtype in _KERNEL_DTYPES and (q.is_cuda or _interpreting())

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.context_lens is None or not self._serves(q):
            return self._torch.decode(q, kv_cache, meta, scale)
        return self._decode(q, kv_cache, meta.block_tables, meta.context_lens, scale)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                scale: float) -> torch.Tensor:
        """q: (B, h, hd); tables (B, width); lens (B,). The table width bounds the context: no host sync."""
        block_size = kv_cache.shape[2]
        if self.sm_count is None:
            self.sm_count = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        tps = decode_splits(q.shape[0], q.shape[1], tables.shape[1] * block_size, self.sm_count, self.numerics,
                            block_size, self.invariant_tokens_per_split)
        kernels = _kernels()
        if tps is None:
            return kernels.paged_decode_attention(q, kv_cache[0], kv_cache[1], tables, lens, scale)
        return kernels.split_kv_decode_attention(q, kv_cache[0], kv_cache[1], tables, lens, scale, tps)

    def prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.cu_seqlens is None or meta.context_lens is None or meta.pad_index is None or not self._serves(q):
            return gather_attention(q, kv_cache, meta, scale)
        if self.numerics == "invariant":  # one decode row per token: the bits a decode of that token gives
            row = torch.div(meta.pad_index, meta.query_len, rounding_mode="floor")  # (T,) its sequence
            offset = meta.pad_index - row * meta.query_len  # (T,) its index among the new tokens
            starts = meta.context_lens - (meta.cu_seqlens[1:] - meta.cu_seqlens[:-1])  # (B,) cached before
            lens = starts.index_select(0, row) + offset + 1
            return self._decode(q, kv_cache, meta.block_tables.index_select(0, row), lens, scale)
        block_m, block_n = self.prefill_tiles
        return _kernels().varlen_prefill_attention(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.cu_seqlens,
                                                   meta.context_lens, scale, meta.query_len, block_m, block_n)


class _Kernels:
    """The three kernel entry points, imported together on first use."""

    def __init__(self):
        from pat_kernels.paged_decode_attention import paged_decode_attention
        from pat_kernels.split_kv_decode import split_kv_decode_attention
        from pat_kernels.varlen_prefill import varlen_prefill_attention

        self.paged_decode_attention = paged_decode_attention
        self.split_kv_decode_attention = split_kv_decode_attention
        self.varlen_prefill_attention = varlen_prefill_attention


_KERNELS: _Kernels | None = None


def _kernels() -> _Kernels:
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _Kernels()
    return _KERNELS
