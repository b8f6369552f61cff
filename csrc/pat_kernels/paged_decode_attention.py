"""Paged decode attention in Triton: one query token per sequence, K/V read once per KV head.

Layout:
  q               (B, H, D)                              H = KVH * group; any D (padded to a power of two)
  k_cache/v_cache (num_blocks, page, KVH, D)             one layer's keys or values, same strides
  block_tables    (B, width) int32/int64                 page ids; context_lens (B,) int32/int64
  out             (B, H, D), q's dtype

Two kernels (flash-decoding, grouped as in SGLang's and vLLM's Triton decode kernels; written here):

1. ``_decode_partial_kernel``, grid (B, KVH, S). Program (b, j, s) holds the ``group`` query heads of
   KV head ``j`` as one (GROUP_PAD, D) tile, so each K/V byte is read once for all of them, and walks
   split ``s`` of sequence ``b``'s context ``BLOCK_N`` tokens (several pages) per iteration: a
   gather of page ids, one (BLOCK_N, D) load of K, scores by ``tl.dot``, an online softmax, one load
   of V, ``tl.dot`` into a float32 accumulator. It writes float32 partials (acc, m, l) per head, or,
   with a single split, the normalised output itself (no second launch).
2. ``_decode_reduce_kernel``, grid (B, H): merges the sequence's non-empty splits in index order.
   Or, with ``fuse_reduce``, no second launch: each non-empty split counts itself done on a per-(row,
   KV head) counter after storing its partials, and the one that finds itself last merges them (the
   same ``_merge_splits``, the same order, so the same arithmetic), then sets the counter back to zero
   for the next call (a CUDA graph replays it as it is). It saves a launch and a pass over the
   partials per layer, which at batch 1 and a short context is most of the reduce's cost (1.7 us a
   layer against the split kernel's 8.7 on the fourth H100 run). Off by default until a GPU run times
   it (bench/gpucheck/attention.py's latency table).

Split rule (the caller's, ``pat_engine/model/layers/triton_attention.py``): either a fixed
``tokens_per_split`` (the invariant mode: split ``s`` of every sequence covers tokens
``[s * tps, (s + 1) * tps)``; the grid has ``ceil(width * page / tps)`` splits, those past a
sequence's length are empty), or ``num_splits`` even splits of each sequence's own length, each a
whole number of ``BLOCK_N`` tokens (fast mode: the grid, and so the CUDA graph, is fixed by the batch,
while each row divides its own context).

Numerics contract: a (sequence, head)'s value depends only on its query row, its length, its K/V,
``tokens_per_split`` (or ``num_splits``) and the compile constants (BLOCK_N, GROUP_PAD, D): never on
the batch, the other rows' lengths, the table width, the grid's split count (fixed mode) or which
other heads share the tile (each output row is its own dot products). Scores and the softmax are
float32; P is rounded to the model dtype for the P.V product as flash attention does (float32
models keep IEEE float32 products: no TF32). Under Triton's CPU interpreter, whose ``tl.dot`` reads
16-bit floats wrongly, 16-bit tiles are widened to float32 first: the products are exact either way,
so only the order of the float32 sums may differ from the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pat_kernels.dependent_launch import pdl_options, pdl_wait
from pat_kernels.triton_support import INTERPRETED

BLOCK_N = 64  # tokens per iteration (4 pages of 16): one K and one V tile load each
GROUP_PAD = 16  # query rows of a tile: tl.dot needs 16; models with more q heads per KV head pad further


@triton.jit
def _merge_splits(acc_ptr, ml_ptr, first, used, row_ok, dims, HEAD_PAD: tl.constexpr):
    """The heads' merged (acc, l) over their ``used`` non-empty splits: ``first`` (R,) is each head's split-0
    item in the (B, H, S) partials; the first split as it is, then the others folded in in index order (one
    split: acc / l exactly). Loads skip L1 (``.cg``): with ``fuse_reduce`` other programs wrote them."""
    m = tl.load(ml_ptr + first * 2, mask=row_ok, other=0.0, cache_modifier=".cg")
    l = tl.load(ml_ptr + first * 2 + 1, mask=row_ok, other=1.0, cache_modifier=".cg")
    acc = tl.load(acc_ptr + first[:, None] * HEAD_PAD + dims[None, :], mask=row_ok[:, None], other=0.0,
                  cache_modifier=".cg")
    for s in range(1, used):
        m_s = tl.load(ml_ptr + (first + s) * 2, mask=row_ok, other=0.0, cache_modifier=".cg")
        l_s = tl.load(ml_ptr + (first + s) * 2 + 1, mask=row_ok, other=1.0, cache_modifier=".cg")
        acc_s = tl.load(acc_ptr + (first + s)[:, None] * HEAD_PAD + dims[None, :], mask=row_ok[:, None],
                        other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, m_s)
        c_old = tl.exp(m - m_new)
        c_s = tl.exp(m_s - m_new)
        acc = acc * c_old[:, None] + acc_s * c_s[:, None]
        l = l * c_old + l_s * c_s
        m = m_new
    return acc, l


@triton.jit
def _splits_used(length, fixed_tokens_per_split, num_splits, BLOCK_N: tl.constexpr):
    """(tokens per split, non-empty splits) of a row of ``length`` tokens; each non-empty split holds >= 1."""
    if fixed_tokens_per_split > 0:
        tps = fixed_tokens_per_split
    else:  # even split of this row's own length, whole BLOCK_N chunks
        tps = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    return tps, tl.cdiv(length, tps)


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, acc_ptr, ml_ptr, out_ptr, count_ptr,
    scale, fixed_tokens_per_split, num_splits,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_tb,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, FUSED: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    heads_total = tl.num_programs(1) * GROUP
    length = tl.load(lens_ptr + seq).to(tl.int32)
    tps, used = _splits_used(length, fixed_tokens_per_split, num_splits, BLOCK_N)
    start = split * tps
    end = tl.minimum(start + tps, length)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # (GROUP_PAD, HEAD_PAD)
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_PAD), tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_tb
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        valid = toks < end
        pages = tl.load(table + toks // PAGE, mask=valid, other=0).to(tl.int64)
        offs = (pages[:, None] * stride_kb + (toks % PAGE)[:, None] * stride_kt + kv_head * stride_kh
                + dims[None, :])  # (BLOCK_N, HEAD_PAD)
        kv_mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(valid[None, :], scores * scale, float("-inf"))  # (GROUP_PAD, BLOCK_N)
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        elif UPCAST:  # P rounded as on the device, the product in float32 (exact for 16-bit inputs)
            pv = tl.dot(p.to(v_ptr.dtype.element_ty).to(tl.float32), v.to(tl.float32))
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new

    out_offs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :]
    out_mask = row_ok[:, None] & dim_ok[None, :]
    if DIRECT:  # one split: this is the whole context
        out = acc / l[:, None]
        tl.store(out_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # partials laid out (B, H, S, ...) contiguous
        first = (seq * heads_total + heads) * tl.num_programs(2)  # (GROUP_PAD,) each head's split 0
        item = first + split
        tl.store(acc_ptr + item[:, None] * HEAD_PAD + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_ptr + item * 2, m, mask=row_ok)
        tl.store(ml_ptr + item * 2 + 1, l, mask=row_ok)
        if FUSED:
            if split < used:  # empty splits neither count nor merge
                counter = count_ptr + seq * tl.num_programs(1) + kv_head
                tl.debug_barrier()  # every thread's partials stored before the count releases them
                done = tl.atomic_add(counter, 1, sem="acq_rel")  # splits of this (row, KV head) done before
                if done == used - 1:  # the last one: the others' partials are visible (acquire)
                    tl.debug_barrier()
                    tl.store(counter, 0)  # ready for the next call; nobody else touches it in this one
                    merged, total = _merge_splits(acc_ptr, ml_ptr, first, used, row_ok, dims, HEAD_PAD)
                    tl.store(out_offs, (merged / total[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    acc_ptr, ml_ptr, lens_ptr, out_ptr,
    fixed_tokens_per_split, num_splits,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_PAD)
    length = tl.load(lens_ptr + seq).to(tl.int32)
    _, used = _splits_used(length, fixed_tokens_per_split, num_splits, BLOCK_N)
    one = tl.arange(0, 1)  # a one-head tile, so the merge is _merge_splits's, as the fused path runs it
    first = (seq * tl.num_programs(1) + head) * num_splits + one
    acc, l = _merge_splits(acc_ptr, ml_ptr, first, used, one < 1, dims, HEAD_PAD)
    out = acc / l[:, None]
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + one[:, None] + dims[None, :],  # one[:, None]: 0
             out.to(out_ptr.dtype.element_ty), mask=dims[None, :] < HEAD_DIM)


def grid_splits(width_tokens: int, tokens_per_split: int | None, num_splits: int) -> int:
    """The grid's split count: ``ceil(width / tokens_per_split)`` for a fixed split, else ``num_splits``."""
    if tokens_per_split:
        return max(1, -(-width_tokens // tokens_per_split))
    return max(1, num_splits)


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}  # per device, every buffer allocated, the newest last
_MIN_COUNTERS = 1 << 16  # (row, KV head) pairs: batch 8192 at 8 KV heads in 256 KB, allocated once


def split_counters(device: torch.device, pairs: int) -> torch.Tensor:
    """The fused reduce's per-(row, KV head) counters on ``device``: zeros, and zeros again after every call
    (each merge resets its own), so one buffer serves every layer, step and CUDA graph, as long as the calls
    run one at a time (one stream: a process's decode steps do). Allocated on the first call; a call with
    more pairs (the invariant mode's prefill, a row a token) allocates a larger one, never while a graph is
    captured, and the old one stays allocated: a graph captured over it still points at it."""
    kept = _COUNTERS.setdefault(device, [])
    if not kept or kept[-1].numel() < pairs:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            have = kept[-1].numel() if kept else 0
            raise RuntimeError(f"the fused decode reduce needs {pairs} counters, more than the {have} allocated "
                               "before this CUDA graph capture: run the largest batch eagerly first")
        kept.append(torch.zeros(max(_MIN_COUNTERS, pairs), dtype=torch.int32, device=device))
    return kept[-1]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                           tokens_per_split: int | None = None, num_splits: int = 1,
                           block_n: int = BLOCK_N, fuse_reduce: bool = False) -> torch.Tensor:
    """Decode attention over the paged pool; no host sync (the split count is read off shapes).

    Args:
        q: (B, H, D), unit stride in D (rows and heads may be strided: a view of the fused projection).
        k_cache, v_cache: (num_blocks, page, KVH, D), the same strides, unit stride in D.
        block_tables: (B, width). context_lens: (B,), each >= 1 and <= width * page.
        scale: the softmax scale.
        tokens_per_split: a fixed split (the invariant mode), a multiple of ``block_n``; or None for
            ``num_splits`` even splits of each row's own length (1: one program per (row, KV head)).
        block_n: tokens per iteration, a power of two >= 16 (a compile constant: fix it per engine,
            the bits depend on it).
        fuse_reduce: with several splits, the last split of each (row, KV head) merges them instead of a
            second kernel (the same merge, in the same order).
    Returns:
        (B, H, D) in q's dtype.
    """
    b, h, d = q.shape
    _, page, kvh, _ = k_cache.shape
    group = h // kvh
    assert h % kvh == 0 and page & (page - 1) == 0 and block_n >= 16 and block_n & (block_n - 1) == 0
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    assert tokens_per_split is None or (tokens_per_split > 0 and tokens_per_split % block_n == 0), \
        "tokens_per_split: a multiple of block_n"
    tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    lens = context_lens if context_lens.stride(-1) == 1 else context_lens.contiguous()
    splits = grid_splits(tables.shape[1] * page, tokens_per_split, num_splits)
    head_pad = max(16, triton.next_power_of_2(d))
    out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    direct = splits == 1
    fused = fuse_reduce and not direct
    if direct:  # unused pointers: out stands in
        acc = ml = out
    else:
        acc = torch.empty(b, h, splits, head_pad, dtype=torch.float32, device=q.device)
        ml = torch.empty(b, h, splits, 2, dtype=torch.float32, device=q.device)
    counters = split_counters(q.device, b * kvh) if fused else lens  # lens: an unused pointer
    fixed = tokens_per_split or 0
    pdl = pdl_options(q.device)
    _decode_partial_kernel[(b, kvh, splits)](
        q, k_cache, v_cache, tables, lens, acc, ml, out, counters,
        scale, fixed, splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(GROUP_PAD, triton.next_power_of_2(group)), PAGE=page,
        HEAD_DIM=d, HEAD_PAD=head_pad, BLOCK_N=block_n,
        DIRECT=direct, FUSED=fused, IEEE=q.dtype == torch.float32, UPCAST=INTERPRETED and q.dtype != torch.float32,
        num_warps=4, num_stages=2, **pdl,
    )
    if not direct and not fused:
        _decode_reduce_kernel[(b, h)](
            acc, ml, lens, out,
            fixed, splits,
            out.stride(0), out.stride(1),
            HEAD_DIM=d, HEAD_PAD=head_pad, BLOCK_N=block_n,
            num_warps=1, **pdl,
        )
    return out
