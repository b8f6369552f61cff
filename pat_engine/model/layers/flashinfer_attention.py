"""``FlashInferAttention``: flashinfer's paged decode and prefill wrappers behind ``AttentionBackend``.

Optional: flashinfer comes with the ``gpu`` extra (``pip install -e ".[gpu]"``) and is imported
when the backend is built, never when this module is, so registering it costs nothing where
flashinfer is absent; choosing it there raises an ``ImportError`` that says what to install.

The pool's halves are flashinfer's "NHD" layout as they are: K and V each
``(num_blocks, block_size, kv_heads, head_dim)``. The step's block tables become flashinfer's CSR
page lists once per step (``plan``, on the first layer; the same ``AttentionMetadata`` object
serves every layer), then every layer runs on the plan.

Not for ``numerics="invariant"``: planned as here, flashinfer chooses its KV split per batch, so a
sequence's bits would follow its batch (use "triton" or "torch"; flashinfer's fixed-split plan
options, where a version has them, are not wired). Never run here (no GPU was lent
to this work): the calls follow flashinfer's documented wrapper API (0.2 and later).
"""

from __future__ import annotations

import torch

from pat_engine.model.layers.attention import AttentionBackend, AttentionMetadata, TorchAttention

_INSTALL = 'pip install -e ".[gpu]"'
_WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's documented default scratch


def _flashinfer():
    try:
        import flashinfer
    except ImportError as missing:
        raise ImportError(f'the "flashinfer" attention backend needs flashinfer ({missing}): {_INSTALL}') from None
    return flashinfer


class FlashInferAttention(AttentionBackend):
    """Decode through ``BatchDecodeWithPagedKVCacheWrapper``, prefill through ``BatchPrefillWithPagedKVCacheWrapper``."""

    name = "flashinfer"

    def __init__(self, numerics: str = "fast"):
        if numerics == "invariant":
            raise ValueError('the "flashinfer" attention backend does not keep numerics="invariant" '
                             '(its KV split follows the batch): use "triton" or "torch"')
        self._fi = _flashinfer()
        self._torch = TorchAttention()  # the KV write
        self._wrappers: dict[bool, object] = {}  # is_prefill -> wrapper, built on the first CUDA step
        self._planned: tuple[AttentionMetadata, int] | None = None  # (the planned step's metadata, heads), held
        # so that a later step's metadata cannot reuse its address

    def load(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self._torch.write_kv(kv_cache, k, v, slots)

    def _wrapper(self, prefill: bool, device: torch.device):
        if prefill not in self._wrappers:
            workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            cls = self._fi.BatchPrefillWithPagedKVCacheWrapper if prefill else self._fi.BatchDecodeWithPagedKVCacheWrapper
            self._wrappers[prefill] = cls(workspace, "NHD")
        return self._wrappers[prefill]

    def _plan(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float):
        """The step's page lists, planned once per ``meta`` (a host sync, once per step, not per layer)."""
        wrapper = self._wrapper(meta.is_prefill, q.device)
        if self._planned is not None and self._planned[0] is meta and self._planned[1] == q.shape[1]:
            return wrapper
        _, _, bs, kvh, hd = kv_cache.shape
        lens = meta.context_lens.to(torch.int32)
        pages = (lens + bs - 1) // bs  # (B,)
        indptr = torch.zeros(pages.numel() + 1, dtype=torch.int32, device=q.device)
        indptr[1:] = torch.cumsum(pages, 0)
        used = torch.arange(meta.block_tables.shape[1], device=q.device)[None, :] < pages[:, None]
        indices = meta.block_tables[used].to(torch.int32)  # each row's pages, rows back to back
        last_page_len = lens - (pages - 1) * bs
        common = dict(sm_scale=scale, q_data_type=q.dtype)
        if meta.is_prefill:
            wrapper.plan(meta.cu_seqlens.to(torch.int32), indptr, indices, last_page_len, q.shape[1], kvh, hd, bs,
                         causal=True, kv_data_type=kv_cache.dtype, **common)
        else:
            wrapper.plan(indptr, indices, last_page_len, q.shape[1], kvh, hd, bs, data_type=kv_cache.dtype, **common)
        self._planned = (meta, q.shape[1])
        return wrapper

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not q.is_cuda or meta.context_lens is None:
            return self._torch.decode(q, kv_cache, meta, scale)
        return self._plan(q, kv_cache, meta, scale).run(q, (kv_cache[0], kv_cache[1]))

    def prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not q.is_cuda or meta.cu_seqlens is None or meta.context_lens is None:
            return self._torch.prefill(q, kv_cache, meta, scale)
        return self._plan(q, kv_cache, meta, scale).run(q, (kv_cache[0], kv_cache[1]))
