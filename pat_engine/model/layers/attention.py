"""Paged attention over a per-layer KV pool, behind a swappable ``AttentionBackend``.

KV pool of one layer: ``(2, num_blocks, block_size, kv_heads_local, head_dim)``;
a token at position ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

A backend writes the step's new K/V and runs decode (one query per row) and prefill (packed new
tokens) attention; ``attention_backend`` is the one place one is chosen (docs/attention.md):

- ``"torch"`` (``TorchAttention``, the default): decode reads the pool in place with a kernel where
  one serves, on CUDA the one-program Triton kernel (``pat_kernels/paged_decode_attention.py``), on
  the CPU the C++ kernel (``pat_kernels/cpu/paged_decode_attention.cpp``, float32/float64/bfloat16,
  built on first use and cached; ``PAT_CPU_ATTENTION=torch`` turns it off). Otherwise, and for
  prefill, the torch path gathers whole context blocks and runs ``scaled_dot_product_attention``
  with the step's mask.
- ``"triton"`` (``triton_attention.TritonAttention``): split-KV decode for the long tail, a varlen
  prefill kernel, and a fixed split size in the invariant numerics mode.
- ``"flashinfer"`` (``flashinfer_attention.FlashInferAttention``): optional, needs the ``gpu`` extra.

The last two are imported only when chosen, so neither Triton nor flashinfer is needed to import this.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

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


@dataclass
class AttentionMetadata:
    """Per-step batch geometry, built once (worker/step_inputs.py) and shared by every layer.

    Every sequence of the step is one row of a padded batch: ``query_len`` query slots
    (1 in decode) over its context, which is read from the pool through ``block_tables``
    (B, blocks); which context tokens each query sees (causal, and only the row's own tokens)
    follows from ``context_lens`` and, in a prefill, ``cached_lens``. Only the torch path needs
    that as a mask, (B, 1, query_len, blocks * block_size): it derives it on the device when it
    first runs and keeps it for the step's other layers (``torch_mask``), so the paged kernels'
    steps (and their graphs) never build one, and no prefill builds one on the host (8 x 4K: a
    134 MB mask). Prefill packs its T new tokens; ``pad_index`` (T,) places each in the padded
    (B * query_len) layout.
    Gathering whole blocks copies contiguous runs of ``block_size`` tokens, several
    times faster on CPU than gathering token by token. The paged kernels read
    ``context_lens`` (decode and prefill) and ``cu_seqlens`` (prefill, the varlen kernel)
    instead of the mask.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # (N,) slot of each new token; N may be below the rows (decode padding)
    query_len: int
    block_tables: torch.Tensor
    pad_index: torch.Tensor | None = None  # prefill only
    context_lens: torch.Tensor | None = None  # (B,) each row's context after this step (cached + new tokens)
    cached_lens: torch.Tensor | None = None  # (B,) prefill: each row's tokens cached before this step
    cu_seqlens: torch.Tensor | None = None  # (B + 1,) prefill: row b's new tokens are packed rows cu[b] .. cu[b + 1]
    # prefill of ragged prompts on the torch path: rows of similar length run as separate padded groups
    # (each part's ``tokens`` says which of the step's packed tokens it holds; the whole step's fields
    # still describe the whole step for the varlen kernels)
    parts: list["AttentionMetadata"] | None = None
    tokens: torch.Tensor | None = None  # in a part: (t,) indices into the step's packed tokens
    # prefill, no row with cached tokens: query i sees keys 0..i, torch's ``is_causal``, which lets SDPA skip the
    # blocks above the diagonal (a padding query then sees keys past its row; its output is dropped)
    causal: bool = False
    _mask: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def torch_mask(self, columns: int) -> torch.Tensor:
        """(B, 1, query_len, columns) bool: query i of row b sees context token j when j <= cached_b + i
        (a prefill's padding queries: the row's last token's view), or, one query a row, when
        j < context_lens_b. Built on first use, on the lengths' device, and kept for the step."""
        if self._mask is None:
            cols = torch.arange(columns, device=self.context_lens.device)
            if self.pad_index is None:  # one query a row: it sees its first context_lens tokens
                self._mask = (cols[None, :] < self.context_lens[:, None])[:, None, None, :]
            else:
                steps = torch.arange(self.query_len, device=cols.device)
                seen = torch.minimum(self.cached_lens[:, None] + steps[None, :], self.context_lens[:, None] - 1)
                self._mask = (cols[None, None, :] <= seen[:, :, None])[:, None]
        return self._mask


@runtime_checkable
class AttentionBackend(Protocol):
    """What the attention layer calls; q: (T, h, hd), k, v: (T, kvh, hd), one layer's pool as above."""

    name: str

    def load(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Build or load kernels now (worker start-up) rather than in the first step, which would
        stall that DP group mid-batch.

        Returns:
            Whether a decode kernel serves this device and dtype (False: a fallback path runs).
        """
        ...

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store the new tokens' K/V at ``slots`` (N,); the first N of the T rows of k, v are real."""
        ...

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """One query per row (``meta.is_prefill`` False), over K/V already written.

        Args:
            q: (B, h, hd), row i the newest token of sequence i (padding rows allowed).
            kv_cache: the layer's pool.
            meta: the step's geometry (``block_tables``, ``context_lens``, ``mask``).
            scale: the softmax scale.
        Returns:
            (B, h, hd).
        """
        ...

    def prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """The step's new tokens, packed (``meta.pad_index`` places them), over K/V already written.

        Args:
            q: (T, h, hd).
            kv_cache, meta, scale: as for ``decode``.
        Returns:
            (T, h, hd).
        """
        ...


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


class TorchAttention(AttentionBackend):
    """Decode through a paged kernel where one serves (Triton on CUDA, C++ on the CPU), else, and for
    prefill, gather whole context blocks and run torch's ``scaled_dot_product_attention``."""

    name = "torch"

    def __init__(self, numerics: str = "fast"):
        self.numerics = numerics

    def load(self, device: torch.device, dtype: torch.dtype) -> bool:
        """The CPU kernels build in about 15 s on a cold cache, 0.2-1 s warm; on CUDA the Triton decode
        kernel serves every dtype but float64. The invariant mode needs one: the fallback, torch's SDPA
        over the batch's widest row, would make a request's bits follow its batch (float64 claims none)."""
        served = self._decode_kernel_serves(device, dtype)
        if self.numerics == "invariant" and dtype != torch.float64 and not served:
            raise ValueError(
                f"numerics='invariant' needs a paged decode kernel for {dtype} on {device.type}, and there is "
                f"none here (on the CPU: the C++ kernels are switched off by PAT_CPU_ATTENTION or were not "
                f"built: g++ and ninja, see csrc/README.md). The fallback, torch's SDPA over the batch's widest "
                f"row, would make a request's bits follow its batch")
        return served

    def _decode_kernel_serves(self, device: torch.device, dtype: torch.dtype) -> bool:
        if device.type == "cuda":
            return dtype != torch.float64 and _triton_decode() is not None
        if device.type != "cpu":
            return False
        if _KERNELS_MISSING is not None:  # said once per worker: every CPU kernel is off, silently slower otherwise
            log.warning("pat_kernels cannot be imported (%s): the CPU kernels are off and the torch paths run; "
                        "install pat-engine (pip install -e .) or put csrc/ on PYTHONPATH", _KERNELS_MISSING)
            return False
        return cpu_decode_kernel(dtype) is not None

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        if kv_cache.device.type == "cpu" and cpu_write_kv is not None and cpu_write_kv(kv_cache, k, v, slots):
            return
        kvh, hd = kv_cache.shape[-2:]
        n = slots.shape[0]
        kv_cache[0].view(-1, kvh, hd).index_copy_(0, slots, k[:n])
        kv_cache[1].view(-1, kvh, hd).index_copy_(0, slots, v[:n])

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.context_lens is not None:
            if q.is_cuda:
                kernel = _triton_decode() if q.dtype != torch.float64 else None
                if kernel is not None:
                    return kernel(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.context_lens, scale)
            elif q.device.type == "cpu":
                kernel = cpu_decode_kernel(q.dtype)
                if kernel is not None and kv_cache.is_contiguous():  # it indexes the pool by offsets
                    return kernel(q, kv_cache, meta.block_tables, meta.context_lens, scale)
        return gather_attention(q, kv_cache, meta, scale)

    def prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return gather_attention(q, kv_cache, meta, scale)


def gather_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The torch path, prefill and decode alike: gather each row's context blocks, then SDPA with the mask."""
    if meta.parts is not None:  # ragged prefill: one padded call per group of similar rows
        out = torch.empty_like(q)
        for part in meta.parts:
            out.index_copy_(0, part.tokens, gather_attention(q.index_select(0, part.tokens), kv_cache, part, scale))
        return out
    kvh, hd = kv_cache.shape[-2:]
    b, nb = meta.block_tables.shape
    # index_select over whole blocks (contiguous rows) is several times faster than advanced indexing
    blocks = kv_cache.view(2, kv_cache.shape[1], -1).index_select(1, meta.block_tables.reshape(-1))
    kv = blocks.view(2, b, -1, kvh, hd).transpose(2, 3)  # (2, B, kvh, nb*bs, hd)
    n, heads = meta.query_len, q.shape[1]
    if meta.pad_index is None:  # decode: one query per row, already in batch order
        qb = q.view(b, n, heads, hd)
    else:
        qb = q.new_zeros(b * n, heads, hd).index_copy_(0, meta.pad_index, q).view(b, n, heads, hd)
    # causal skips the masked blocks, which only added zeros: on the CPU the mask's bits (tests/test_prefill_groups.py)
    # and a 2000-token prompt's prefill 1.3-1.45x (bench/results/revision_ab_h768.md); on CUDA, where this path serves
    # float64, a forced torch backend or a missing Triton, SDPA may pick another kernel (the fast mode's rounding)
    mask = None if meta.causal else meta.torch_mask(kv.shape[-2])
    out = F.scaled_dot_product_attention(
        qb.transpose(1, 2), kv[0], kv[1], attn_mask=mask, is_causal=meta.causal, scale=scale, enable_gqa=True
    )  # (B, h, n, hd)
    out = out.transpose(1, 2).reshape(b * n, heads, hd)
    return out if meta.pad_index is None else out.index_select(0, meta.pad_index)


def _torch_backend(numerics: str = "fast") -> AttentionBackend:
    return TorchAttention(numerics)  # its decode kernels compute each (row, head) whole; prefill_as_decode does the rest


def _triton_backend(numerics: str = "fast") -> AttentionBackend:
    from pat_engine.model.layers.triton_attention import TritonAttention

    return TritonAttention(numerics)


def _flashinfer_backend(numerics: str = "fast") -> AttentionBackend:
    from pat_engine.model.layers.flashinfer_attention import FlashInferAttention

    return FlashInferAttention(numerics)


# name -> factory taking the engine's numerics mode; the factories import their modules on call
_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {
    "torch": _torch_backend, "triton": _triton_backend, "flashinfer": _flashinfer_backend,
}


BACKEND_NAMES = ("auto", *_BACKENDS)  # what EngineConfig.attention_backend accepts


def attention_backend(name: str = "torch", numerics: str = "fast", device: torch.device | None = None) -> AttentionBackend:
    """The one place a backend is chosen by name, for the engine's numerics mode (docs/numerics.md).
    "auto": the Triton kernels on a CUDA device where Triton imports, else torch (on the CPU, torch
    with the C++ decode kernel)."""
    if name == "auto":
        name = "triton" if device is not None and device.type == "cuda" and _triton_decode() is not None else "torch"
    if name not in _BACKENDS:
        raise ValueError(f"attention backend must be one of {sorted(BACKEND_NAMES)}, got {name!r}")
    return _BACKENDS[name](numerics)


DEFAULT_BACKEND = attention_backend()


def load_decode_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """The default backend's ``load`` (what a worker calls at start-up)."""
    return DEFAULT_BACKEND.load(device, dtype)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """The default backend's ``write_kv``."""
    DEFAULT_BACKEND.write_kv(kv_cache, k, v, slots)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, backend: AttentionBackend = DEFAULT_BACKEND) -> torch.Tensor:
    """q: (T, h, hd); k, v: (T, kvh, hd) for the new tokens. Returns (T, h, hd).

    One attention call for the whole batch, prefill and decode alike (no loop over sequences).
    """
    backend.write_kv(kv_cache, k, v, meta.slot_mapping)
    return attend(q, kv_cache, meta, scale, backend)


def attend(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
           backend: AttentionBackend = DEFAULT_BACKEND) -> torch.Tensor:
    """Attention of q (T, h, hd) over K/V already in the pool (the new tokens' too). Returns (T, h, hd)."""
    return backend.prefill(q, kv_cache, meta, scale) if meta.is_prefill else backend.decode(q, kv_cache, meta, scale)
