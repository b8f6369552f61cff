"""Split-KV (flash-decoding) paged decode attention in Triton: one query token per sequence.

A decode step of few sequences (the tail of an RL rollout: a handful of long responses) gives
the one-program-per-(seq, head) kernel (``paged_decode_attention.py``) too few programs to fill
a GPU, and each of them walks the whole context alone. This kernel cuts each context into
splits of ``tokens_per_split`` tokens (a multiple of the block size), so the grid grows with the
context instead of the batch:

1. ``_split_partial_kernel``, grid (B, H, S): program (b, h, s) runs the one-program kernel's
   online softmax over the KV blocks of split ``s`` only, block by block in order, and writes a
   float32 partial: the unnormalised accumulator ``acc`` (D,), the running max ``m`` and the
   sum of exponentials ``l``. Splits past a sequence's length loop zero times (never read).
2. ``_split_reduce_kernel``, grid (B, H): merges the partials of splits ``0 .. ceil(len / tps) - 1``
   of its own sequence in that fixed order (rescaling by ``exp(m_s - m)``), then divides once.

Every value depends only on its sequence (query row, length, block table, KV) and on
``tokens_per_split``: not on the batch, the other sequences' lengths, the grid's split count or
the number of heads. Which ``tokens_per_split`` to use is the caller's rule
(``pat_engine/model/layers/triton_attention.py``, ``decode_splits``).

Shapes (as in ``paged_decode_attention.py``):
  q               (B, H, D)                             H = KVH * group; D a power of two
  k_cache/v_cache (num_blocks, block_size, KVH, D)      one layer, keys or values
  block_tables    (B, max_blocks) int32/int64, context_lens (B,) int32/int64,
                  context_lens[b] <= max_blocks * block_size
  out             (B, H, D), q's dtype
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pat_kernels.paged_decode_attention import attend_block


@triton.jit
def _split_partial_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, acc_ptr, ml_ptr,
    scale, blocks_per_split,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_tb,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + dims).to(tl.float32)
    length = tl.load(lens_ptr + seq)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(length, BLOCK_SIZE))
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.zeros((), tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    for i in range(first, last):  # the same per-block step as the one-program kernel
        m, l, acc = attend_block(q, k_ptr, v_ptr, tables_ptr, seq, i, length, m, l, acc, scale,
                                 stride_kb, stride_kt, stride_kh, stride_tb, kv_head, BLOCK_SIZE, HEAD_DIM)
    # partials are laid out (B, H, S, ...) contiguous; the grid gives H and S
    item = (seq * tl.num_programs(1) + head) * tl.num_programs(2) + split
    tl.store(acc_ptr + item * HEAD_DIM + dims, acc)
    tl.store(ml_ptr + item * 2, m)
    tl.store(ml_ptr + item * 2 + 1, l)


@triton.jit
def _split_reduce_kernel(
    acc_ptr, ml_ptr, lens_ptr, out_ptr,
    tokens_per_split, num_splits,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    length = tl.load(lens_ptr + seq)
    base = (seq * tl.num_programs(1) + head) * num_splits
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.zeros((), tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    # only this sequence's own splits, in index order: the merge never sees the batch's longest context
    for s in range(0, tl.cdiv(length, tokens_per_split)):
        m_s = tl.load(ml_ptr + (base + s) * 2)
        l_s = tl.load(ml_ptr + (base + s) * 2 + 1)
        acc_s = tl.load(acc_ptr + (base + s) * HEAD_DIM + dims)
        m_new = tl.maximum(m, m_s)
        c_old = tl.exp(m - m_new)  # 0 on the first split (m = -inf); every split read holds >= 1 token
        c_s = tl.exp(m_s - m_new)
        acc = acc * c_old + acc_s * c_s
        l = l * c_old + l_s * c_s
        m = m_new
    out = acc / l
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def split_kv_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                              tokens_per_split: int) -> torch.Tensor:
    """Decode attention with each context cut into splits of ``tokens_per_split`` tokens.

    Args:
        q: (B, H, D). k_cache, v_cache: (num_blocks, block_size, KVH, D), same strides.
        block_tables: (B, max_blocks). context_lens: (B,), each at most max_blocks * block_size.
        scale: the softmax scale.
        tokens_per_split: a multiple of block_size; the split count is read off the table width
            (a shape, so no host sync), and each sequence reduces only its own splits.
    Returns:
        (B, H, D) in q's dtype.
    """
    b, h, d = q.shape
    _, block_size, kvh, _ = k_cache.shape
    assert h % kvh == 0 and d & (d - 1) == 0 and block_size & (block_size - 1) == 0
    assert tokens_per_split > 0 and tokens_per_split % block_size == 0, "tokens_per_split: a multiple of block_size"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    lens = context_lens.contiguous()
    splits = max(1, -(-tables.shape[1] * block_size // tokens_per_split))
    acc = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(b, h, splits, 2, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    _split_partial_kernel[(b, h, splits)](
        q, k_cache, v_cache, tables, lens, acc, ml,
        scale, tokens_per_split // block_size,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.stride(0),
        GROUP=h // kvh, BLOCK_SIZE=block_size, HEAD_DIM=d,
    )
    _split_reduce_kernel[(b, h)](
        acc, ml, lens, out,
        tokens_per_split, splits,
        out.stride(0), out.stride(1),
        HEAD_DIM=d,
    )
    return out
