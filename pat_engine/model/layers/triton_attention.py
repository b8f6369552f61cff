"""``TritonAttention``: the Triton kernels of ``pat_kernels`` behind the ``AttentionBackend`` protocol.

- decode: the grouped paged kernel (``pat_kernels/paged_decode_attention.py``: one program per
  (sequence, KV head, split), the KV head's query heads together), cut as ``decode_split`` says;
- prefill (``numerics="fast"``): the packed varlen kernel, no padding to the longest prompt;
- ``numerics="invariant"``: every decode with one fixed split size, and prefill through that same
  decode path, one query row per token (as ``prefill_as_decode`` gives the torch backend), so
  prefilled KV equals decoded KV and nothing depends on the batch or on the heads a rank holds
  (docs/attention.md).

Nothing here imports Triton at module import: the kernels load on first use, so the backend
can be registered (``attention.py``) on machines without Triton. Tensors on the CPU run the
kernels only under ``TRITON_INTERPRET=1`` (the tests); otherwise the torch path serves them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pat_engine import env
from pat_engine.model.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchAttention,
    gather_attention,
)

log = logging.getLogger(__name__)

NUMERICS = ("fast", "invariant")  # as pat_engine.config.NUMERICS
INVARIANT_TOKENS_PER_SPLIT = 256  # one split size for every decode of the invariant mode
MIN_TOKENS_PER_SPLIT = 128  # fast mode: each split reads >= 128 tokens, so its partial (D + 2 floats a head) stays small
# fast mode: splits are added until the grid has this many programs per SM. 3, from the H100 sweep in
# bench/results/gpu_check.md (part 1): at 4, 64 x 512 and 64 x 2048 took a second split and lost 9% and 4%
# of their bandwidth; the tail shapes sit within 1-2% of their best anywhere between 3 and 4.
PROGRAMS_PER_SM = 3
DECODE_BLOCK_N = 64  # tokens per kernel iteration; a compile constant of the engine (the bits depend on it)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # float64 keeps the torch path


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class DecodeSplit:
    """How a decode step's attention is cut: a fixed ``tokens_per_split`` (every row's split ``s`` covers
    tokens ``[s * tps, (s + 1) * tps)``), or, when that is None, ``num_splits`` even splits of each row's
    own length (1: one program per (row, KV head) walks the whole context)."""

    tokens_per_split: int | None
    num_splits: int = 1


def decode_split(batch: int, kv_heads: int, width_tokens: int, sm_count: int, numerics: str,
                 block_n: int = DECODE_BLOCK_N,
                 invariant_tokens_per_split: int = INVARIANT_TOKENS_PER_SPLIT) -> DecodeSplit:
    """The split of one decode step.

    Args:
        batch: rows of the step (padding rows included). kv_heads: KV heads on this rank (one program
            serves a KV head's query heads together).
        width_tokens: the block table's width in tokens (an upper bound of the longest context; with
            CUDA graphs, ``max_model_len``).
        sm_count: the GPU's streaming multiprocessors. numerics: "fast" or "invariant".
        block_n: the kernel's tokens per iteration. invariant_tokens_per_split: the invariant constant
            (tests shrink it); rounded up to ``block_n``.

    **fast**: ``num_splits`` grows until ``batch * kv_heads * num_splits`` reaches ``PROGRAMS_PER_SM``
    programs per SM, but no further than ``width / MIN_TOKENS_PER_SPLIT``; each row then divides its
    own context into that many parts (whole ``block_n`` chunks), so a short row of a long-table batch
    uses few of them. The split count follows the batch, so a row's bits follow what it is batched
    with, as in any engine that picks its split per step.

    **invariant**: always the fixed ``invariant_tokens_per_split``, whatever the batch, heads or
    context. Each (row, head) then sums its own splits of that size in index order, so its value is a
    function of the row alone (query, length, KV), never of the batch, the table width, the padding or
    the heads per rank. A short row has one split, the same bits as one program.
    """
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    if numerics == "invariant":
        return DecodeSplit(_round_up(max(invariant_tokens_per_split, block_n), block_n))
    programs = batch * kv_heads
    if programs == 0:
        return DecodeSplit(None, 1)
    wanted = -(-PROGRAMS_PER_SM * sm_count // programs)
    return DecodeSplit(None, max(1, min(wanted, width_tokens // MIN_TOKENS_PER_SPLIT)))


class TritonAttention(AttentionBackend):
    """Paged attention through the Triton kernels (decode: the grouped paged kernel, split by ``decode_split``;
    prefill: varlen, or as decode in the invariant mode)."""

    name = "triton"

    def __init__(self, numerics: str = "fast", sm_count: int | None = None,
                 invariant_tokens_per_split: int = INVARIANT_TOKENS_PER_SPLIT,
                 prefill_tiles: tuple[int, int] = (64, 64), block_n: int = DECODE_BLOCK_N):
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
        self.block_n = block_n  # the decode kernel's tokens per iteration
        self.fuse_reduce = env.fused_decode_reduce()  # the split kernel merges its splits (PAT_DECODE_REDUCE)
        self._torch = TorchAttention(numerics)  # the KV write and the float64 / no-kernel paths

    def load(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether a decode kernel serves this device and dtype: the Triton ones (CUDA, or CPU under the
        interpreter), else the torch backend's."""
        if dtype not in _KERNEL_DTYPES or not (device.type == "cuda" or env.triton_interpreted()):
            return self._torch.load(device, dtype)  # its paths serve these steps
        if device.type == "cuda" and self.sm_count is None:
            self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        _kernels()  # import (and fail) now, not mid-step
        return True

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self._torch.write_kv(kv_cache, k, v, slots)

    def _serves(self, q: torch.Tensor) -> bool:
        return q.dtype in _KERNEL_DTYPES and (q.is_cuda or env.triton_interpreted())

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.context_lens is None or not self._serves(q):
            return self._torch.decode(q, kv_cache, meta, scale)
        return self._decode(q, kv_cache, meta.block_tables, meta.context_lens, scale)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                scale: float) -> torch.Tensor:
        """q: (B, h, hd); tables (B, width); lens (B,). The table width bounds the context: no host sync."""
        if self.sm_count is None:
            self.sm_count = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        split = decode_split(q.shape[0], kv_cache.shape[3], tables.shape[1] * kv_cache.shape[2], self.sm_count,
                             self.numerics, self.block_n, self.invariant_tokens_per_split)
        return _kernels().paged_decode_attention(q, kv_cache[0], kv_cache[1], tables, lens, scale,
                                                 tokens_per_split=split.tokens_per_split,
                                                 num_splits=split.num_splits, block_n=self.block_n,
                                                 fuse_reduce=self.fuse_reduce)

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
    """The kernel entry points, imported together on first use."""

    def __init__(self):
        from pat_kernels.paged_decode_attention import paged_decode_attention
        from pat_kernels.varlen_prefill import varlen_prefill_attention

        self.paged_decode_attention = paged_decode_attention
        self.varlen_prefill_attention = varlen_prefill_attention


_KERNELS: _Kernels | None = None


def _kernels() -> _Kernels:
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _Kernels()
    return _KERNELS
