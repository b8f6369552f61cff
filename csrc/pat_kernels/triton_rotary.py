"""Rotary embedding + KV-cache write in Triton (with Qwen3's per-head q/k RMSNorm first): one pass
over the fused QKV projection, one program per (token, head).

Layout:
  qkv       (T, (H + 2 * KVH) * D)          the projection's output: q heads, then k heads, then v heads
  positions (T,) int64; cos, sin (L, D)     the rotary tables (model dtype, rows by position)
  kv_cache  (2, num_blocks, page, KVH, D)   one layer's pool; token ``t < N`` writes slot ``slots[t]``
  q_norm, k_norm (D,) or None

Program (t, j): for ``j < H`` it normalises (Qwen3) and rotates q head ``j`` of token ``t`` in place
in ``qkv`` (the attention kernels read q through its strides, uncopied); for ``j = H + i`` it
normalises and rotates k head ``i`` and stores it, and v head ``i`` as it is, at the token's slot.
Rows ``t >= N`` (decode padding) rotate their q and write nothing.

Numerics: the torch formulas of ``pat_engine/model/layers/{norm,rotary}.py`` operation by operation,
in the rotate-half convention: ``x * cos + rotate_half(x) * sin`` with each product and the sum
rounded to the model dtype on its own (FMA contraction off), the q/k norm as ``triton_norm``'s
(float32 inside, rounded before and after the weight). Elementwise per head: batch-invariant.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from pat_kernels.dependent_launch import pdl_options, pdl_wait
from pat_kernels.triton_support import INTERPRETED, round_to

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _normed(x, w_ptr, cols, ok, r, DTYPE: tl.constexpr, RTNE: tl.constexpr):
    """``weight * (x * r).to(dtype)`` rounded as the torch formula rounds it."""
    y = round_to(x * r, DTYPE, RTNE).to(tl.float32)
    return round_to(y * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32), DTYPE, RTNE).to(tl.float32)


@triton.jit
def _rotate(x_ptr, cos_ptr, sin_ptr, qn_ptr, d, eps, inv_d,
            HEAD_PAD: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr, DTYPE: tl.constexpr,
            RTNE: tl.constexpr):
    """One head's rotated row, in the model dtype."""
    cols = tl.arange(0, HEAD_PAD)
    ok = cols < d
    partner = tl.where(cols < HALF, cols + HALF, cols - HALF)  # rotate_half's source column
    x = tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + partner, mask=ok, other=0.0).to(tl.float32)
    if NORM:  # Qwen3: RMSNorm of the head before the rotation
        r = tl.math.rsqrt(tl.sum(x * x, axis=0) * inv_d + eps)
        x = _normed(x, qn_ptr, cols, ok, r, DTYPE, RTNE)
        xp = _normed(xp, qn_ptr, partner, ok, r, DTYPE, RTNE)
    rotated = tl.where(cols < HALF, -xp, xp)
    c = tl.load(cos_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    a = round_to(x * c, DTYPE, RTNE).to(tl.float32)
    b = round_to(rotated * s, DTYPE, RTNE).to(tl.float32)
    return round_to(a + b, DTYPE, RTNE), cols, ok


@triton.jit
def _rotary_kv_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, k_ptr, v_ptr, slots_ptr,
                      stride_t, stride_rope, stride_slot, stride_kh,
                      n_real, d, eps, inv_d,
                      HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_PAD: tl.constexpr, HALF: tl.constexpr,
                      NORM: tl.constexpr, DTYPE: tl.constexpr, RTNE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    cos_row = cos_ptr + pos * stride_rope
    sin_row = sin_ptr + pos * stride_rope
    row = qkv_ptr + t * stride_t
    if j < HEADS:
        head = row + j * d
        out, cols, ok = _rotate(head, cos_row, sin_row, qn_ptr, d, eps, inv_d, HEAD_PAD, HALF, NORM, DTYPE, RTNE)
        tl.store(head + cols, out, mask=ok)
    else:
        i = j - HEADS
        out, cols, ok = _rotate(row + (HEADS + i) * d, cos_row, sin_row, kn_ptr, d, eps, inv_d,
                                HEAD_PAD, HALF, NORM, DTYPE, RTNE)
        if t < n_real:
            slot = tl.load(slots_ptr + t).to(tl.int64)
            dest = slot * stride_slot + i * stride_kh + cols
            tl.store(k_ptr + dest, out, mask=ok)
            v = tl.load(row + (HEADS + KV_HEADS + i) * d + cols, mask=ok, other=0.0)
            tl.store(v_ptr + dest, v, mask=ok)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def rotary_kv_write(qkv: torch.Tensor, heads: int, kv_heads: int, positions: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
                    q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                    eps: float = 1e-6) -> torch.Tensor:
    """Rotate q in place and store rotated k and v in the pool; returns q as a (T, heads, D) view of ``qkv``.

    Args:
        qkv: (T, (heads + 2 * kv_heads) * D), unit stride in the last dim.
        positions: (T,) each token's position. cos, sin: (max_position, D) tables.
        kv_cache: (2, num_blocks, page, kv_heads, D), blocks contiguous. slots: (N,) the first N tokens' slots.
        q_norm, k_norm: Qwen3's per-head RMSNorm weights (D,), both or neither. eps: their epsilon.
    """
    t, width = qkv.shape
    d = kv_cache.shape[-1]
    assert width == (heads + 2 * kv_heads) * d and qkv.stride(-1) == 1 and qkv.dtype in DTYPES
    assert d % 2 == 0 and kv_cache.shape[3] == kv_heads and kv_cache.dtype == qkv.dtype
    pool = kv_cache[0]
    assert pool.stride(-1) == 1 and pool.stride(0) == pool.shape[1] * pool.stride(1), "blocks must be contiguous"
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1 and (q_norm is None) == (k_norm is None)
    if t:
        norm = q_norm is not None
        _rotary_kv_kernel[(t, heads + kv_heads)](
            qkv, positions, cos, sin, q_norm if norm else cos, k_norm if norm else cos,
            kv_cache[0], kv_cache[1], slots,
            qkv.stride(0), cos.stride(0), pool.stride(1), pool.stride(2),
            slots.shape[0], d, eps, float(np.float32(1.0) / np.float32(d)),
            HEADS=heads, KV_HEADS=kv_heads, HEAD_PAD=triton.next_power_of_2(d), HALF=d // 2, NORM=norm,
            DTYPE=_TL_DTYPES[qkv.dtype], RTNE=INTERPRETED, num_warps=1, enable_fp_fusion=False,
            **pdl_options(qkv.device),
        )
    return qkv[:, : heads * d].view(t, heads, d)
