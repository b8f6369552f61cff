"""Paged decode attention in Triton: one query token per sequence, KV read block by block.

Grid: (batch, q_heads). Each program walks its sequence's block table, loads one
KV block of ``block_size`` tokens at a time and keeps an online softmax (running
max ``m``, normaliser ``l`` and accumulator ``acc``), so no padded context is
ever materialised. GQA: q head ``h`` reads KV head ``h // group``.

Shapes:
  q            (B, H, D)
  k_cache/v_cache (num_blocks, block_size, KVH, D)   (one layer, keys or values)
  block_tables (B, max_blocks) int64 (offsets pass 2**31 elements in large pools), context_lens (B,) int32
  out          (B, H, D)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def attend_block(q, k_ptr, v_ptr, tables_ptr, seq, i, length, m, l, acc,
                 scale, stride_kb, stride_kt, stride_kh, stride_tb, kv_head,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One KV block (the ``i``-th of sequence ``seq``) folded into a running online softmax
    ``(m, l, acc)``; shared by the one-program and the split-KV kernels, so both sum in one order."""
    dims = tl.arange(0, HEAD_DIM)
    toks = tl.arange(0, BLOCK_SIZE)
    block = tl.load(tables_ptr + seq * stride_tb + i)
    offs = block * stride_kb + toks[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]
    valid = (i * BLOCK_SIZE + toks) < length
    k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)  # (BLOCK_SIZE, D)
    scores = tl.sum(k * q[None, :], axis=1) * scale
    scores = tl.where(valid, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=0))
    p = tl.exp(scores - m_new)
    correction = tl.exp(m - m_new)
    v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
    acc = acc * correction + tl.sum(p[:, None] * v, axis=0)
    l = l * correction + tl.sum(p, axis=0)
    return m_new, l, acc


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
    scale,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_tb,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + dims).to(tl.float32)
    length = tl.load(lens_ptr + seq)
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.zeros((), tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    for i in range(0, tl.cdiv(length, BLOCK_SIZE)):
        m, l, acc = attend_block(q, k_ptr, v_ptr, tables_ptr, seq, i, length, m, l, acc, scale,
                                 stride_kb, stride_kt, stride_kh, stride_tb, kv_head, BLOCK_SIZE, HEAD_DIM)
    out = acc / l
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    b, h, d = q.shape
    _, block_size, kvh, _ = k_cache.shape
    assert h % kvh == 0 and d & (d - 1) == 0 and block_size & (block_size - 1) == 0
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    out = torch.empty_like(q)
    tables = block_tables.to(torch.int64).contiguous()  # int64: block * stride passes 2**31 on big pools
    lens = context_lens.to(torch.int32).contiguous()
    _paged_decode_kernel[(b, h)](
        q, k_cache, v_cache, tables, lens, out, scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=h // kvh, BLOCK_SIZE=block_size, HEAD_DIM=d,
    )
    return out
