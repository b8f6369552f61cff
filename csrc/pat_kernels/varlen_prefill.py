"""Packed variable-length causal prefill attention over the paged KV pool, in Triton.

The step's new tokens are packed back to back (``cu_seqlens``: sequence ``b`` owns query rows
``cu_seqlens[b] .. cu_seqlens[b + 1]``), with no padding to the longest prompt. Their K/V are
already in the pool (the backend writes them first), so every key is read through the block
table: new token ``i`` of sequence ``b`` sits at position ``start_b + i``, where
``start_b = context_lens[b] - new_b`` tokens were cached before the step, and sees positions
``0 .. start_b + i`` (its cached context plus the causal part of its own new tokens).

Grid (B, ceil(max_new / BLOCK_M), H): program (b, t, h) takes query rows
``t * BLOCK_M ..`` of sequence ``b`` for head ``h`` (GQA: KV head ``h // group``) and returns at
once when the sequence has fewer new tokens, so a short prompt beside a long one costs a few
idle programs, never padded compute or memory. It loops over key tiles of ``BLOCK_N`` tokens
(each token's page looked up in the table, so BLOCK_N is free of the page size) up to the tile's
last query position, with an online softmax in float32 (``tl.dot`` in IEEE float32 for float32
inputs; bfloat16/float16 inputs multiply on tensor cores with float32 accumulation, the
probabilities rounded to the input dtype for the second product, as flash attention does).

Shapes:
  q, out          (T, H, D)                        T = cu_seqlens[-1]; D a power of two
  k_cache/v_cache (num_blocks, block_size, KVH, D)
  block_tables    (B, max_blocks), cu_seqlens (B + 1,), context_lens (B,) cached + new tokens
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pat_kernels.triton_support import INTERPRETED


@triton.jit
def _varlen_prefill_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, cu_ptr, lens_ptr, out_ptr,
    scale,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_tb,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDEN: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_first = tl.load(cu_ptr + seq)
    new = tl.load(cu_ptr + seq + 1) - q_first
    if tile * BLOCK_M >= new:  # this sequence has fewer new tokens than the longest one
        return
    start = tl.load(lens_ptr + seq) - new  # tokens cached before this step
    kv_head = head // GROUP
    dims = tl.arange(0, HEAD_DIM)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) index among the new tokens
    row_ok = rows < new
    q = tl.load(q_ptr + (q_first + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)  # (BLOCK_M, D)
    if WIDEN:
        q = q.to(tl.float32)
    q_pos = start + rows
    kv_end = start + tl.minimum((tile + 1) * BLOCK_M, new)  # keys past the tile's last query are unseen
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
        col_ok = cols < kv_end
        page = tl.load(tables_ptr + seq * stride_tb + cols // PAGE, mask=col_ok, other=0)
        offs = page * stride_kb + (cols % PAGE) * stride_kt + kv_head * stride_kh  # (BLOCK_N,)
        k = tl.load(k_ptr + offs[:, None] + dims[None, :], mask=col_ok[:, None], other=0.0)  # (BLOCK_N, D)
        if WIDEN:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (BLOCK_M, BLOCK_N) float32
        seen = (cols[None, :] <= q_pos[:, None]) & col_ok[None, :]
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: every row sees key 0 in the first tile
        p = tl.exp(scores - m_new[:, None])
        correction = tl.exp(m - m_new)
        v = tl.load(v_ptr + offs[:, None] + dims[None, :], mask=col_ok[:, None], other=0.0)
        if WIDEN:
            v = v.to(tl.float32)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        l = l * correction + tl.sum(p, axis=1)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + (q_first + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def varlen_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, cu_seqlens: torch.Tensor, context_lens: torch.Tensor,
                             scale: float, max_new_tokens: int | None = None,
                             block_m: int = 64, block_n: int = 64, widen: bool | None = None) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged context (new K/V written).

    Args:
        q: (T, H, D) packed new tokens. k_cache, v_cache: (num_blocks, block_size, KVH, D).
        block_tables: (B, max_blocks). cu_seqlens: (B + 1,) query offsets, cu_seqlens[0] = 0.
        context_lens: (B,) each sequence's length after the step (cached + new tokens).
        scale: the softmax scale.
        max_new_tokens: the longest sequence's new tokens (sizes the grid); read from cu_seqlens
            with a host sync when not given.
        block_m, block_n: query and key tile sizes (powers of two; 16 or more on a GPU, for tl.dot).
        widen: multiply in IEEE float32 whatever the input dtype (no tensor cores). None: only
            under TRITON_INTERPRET=1 for bfloat16, whose ``tl.dot`` the interpreter computes on the
            raw bit patterns (unsupported there: triton-lang/triton#11584).
    Returns:
        (T, H, D) in q's dtype.
    """
    t, h, d = q.shape
    _, page, kvh, _ = k_cache.shape
    b = block_tables.shape[0]
    assert h % kvh == 0 and d & (d - 1) == 0 and cu_seqlens.shape[0] == b + 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    if max_new_tokens is None:
        max_new_tokens = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if b else 0
    out = torch.empty_like(q)
    if t == 0 or max_new_tokens == 0:
        return out
    if widen is None:
        widen = q.dtype == torch.bfloat16 and INTERPRETED
    tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    grid = (b, triton.cdiv(max_new_tokens, block_m), h)
    _varlen_prefill_kernel[grid](
        q, k_cache, v_cache, tables, cu_seqlens.contiguous(), context_lens.contiguous(), out,
        scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=h // kvh, PAGE=page, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, WIDEN=widen,
    )
    return out
