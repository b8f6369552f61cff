"""RMSNorm in Triton, optionally fused with the residual add before it: one program per row.

Layout: ``x`` and ``residual`` (rows, n), unit stride in n; ``weight`` (n,). Float32, bfloat16, float16.

Numerics: the formula of ``pat_engine/model/layers/norm.py`` (transformers' RMSNorm), operation by
operation: the residual add rounded to the model dtype (as ``x + residual`` is), the row upcast to
float32, ``mean(x * x)`` as the sum times ``1 / n`` (torch's mean), ``x * rsqrt(mean + eps)``, rounded
to the model dtype, then times the weight and rounded again. FMA contraction is off, so every
product and sum rounds on its own. The sum's order is the kernel's tree (fixed by ``n`` alone), so a
row's bits never depend on the other rows: batch-invariant. Only the order of that one float32 sum
may differ from torch's own kernel. The three steps are jit functions (``residual_add``, ``inv_rms``,
``scaled``) that the skinny GEMM's norm prologue calls too (``pat_kernels/skinny_matmul.py``).
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
def residual_add(x, r, RTNE: tl.constexpr):
    """The residual stream: ``x + residual`` rounded to the model dtype."""
    return round_to(x.to(tl.float32) + r.to(tl.float32), x.dtype, RTNE)


@triton.jit
def inv_rms(x, inv_n, eps):
    """``rsqrt(mean(x * x) + eps)`` of one row (a 1-D block, zeros past its end), in float32."""
    xf = x.to(tl.float32)
    return tl.math.rsqrt(tl.sum(xf * xf, axis=0) * inv_n + eps)


@triton.jit
def scaled(x, inv, w, RTNE: tl.constexpr):
    """``x * inv`` rounded to x's dtype, then times the norm's weight and rounded again."""
    y = round_to(x.to(tl.float32) * inv, x.dtype, RTNE).to(tl.float32)
    return round_to(y * w.to(tl.float32), x.dtype, RTNE)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
                     stride_x, stride_r, stride_o, stride_s,
                     n, eps, inv_n,
                     BLOCK: tl.constexpr, ADD: tl.constexpr, RTNE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:
        x = residual_add(x, tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0), RTNE)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, scaled(x, inv_rms(x, inv_n, eps), w, RTNE), mask=ok)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, n = x.shape
    assert x.stride(-1) == 1 and weight.is_contiguous() and x.dtype in DTYPES
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else None
    if rows == 0:
        return out, summed
    block = triton.next_power_of_2(n)
    inv_n = float(np.float32(1.0) / np.float32(n))  # torch's mean: the sum times 1 / n, in float32
    res = residual if residual is not None else x
    assert res.stride(-1) == 1
    _rms_norm_kernel[(rows,)](
        x, res, weight, out, summed if summed is not None else out,
        x.stride(0), res.stride(0), out.stride(0), out.stride(0),
        n, eps, inv_n,
        BLOCK=block, ADD=residual is not None, RTNE=INTERPRETED,
        num_warps=min(16, max(1, block // 512)), enable_fp_fusion=False, **pdl_options(x.device),
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` (rows, n) normalised and scaled by ``weight``."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    return _launch(x, residual, weight, eps)
