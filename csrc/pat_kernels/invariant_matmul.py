"""Batch-invariant matmul in Triton: the invariant numerics mode's GEMM on CUDA (docs/numerics.md).

cuBLAS picks its kernel (split-K variants included) from the row count, so a row's bits change
with the batch it is in, with the padding of a decode graph and with prefill vs decode. This
kernel fixes the reduction order instead, and reads the weights in place, in the model's dtype.

Layout:
  x      (M, K)      any strides; the rows (tokens) of the step
  weight (N, K)      the layer's (out, in) weight shard, any strides, in the model's dtype
  bias   (N,)        optional
  out    (M, N)      x's dtype (or ``out_dtype``), contiguous
  chunks = C > 1:    out is (C, M, N), float32 by default: out[c] = x[:, c*K/C : (c+1)*K/C] @ the same
                     columns of weight.T, the leaves of a row-parallel product's reduction tree
                     (pat_engine/parallel/reduction_tree.py); no bias (row-parallel layers have none).

Numerics contract: program (m, n, c) holds one float32 accumulator tile and walks its K range
from low to high in ``BLOCK_K`` steps, ``acc = dot(x_tile, w_tile, acc)``, masked tails reading
zeros; the bias is added once after the walk, then one rounding to the output dtype. Every tile
size, warp and stage count is a module constant, never chosen from M, N or K, so an output
element's bits depend only on its row of x, its column of the weight and the K range: not on
the row count, the row's position in the batch, padding rows, the output width or the grid.
float32 inputs multiply in IEEE float32 (no TF32). Against torch's GEMM: equal within rounding,
not bit for bit (another order). Tested under ``TRITON_INTERPRET=1`` (tests/test_invariant_matmul.py),
where each tile's dot runs in numpy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pat_kernels.triton_support import INTERPRETED, dot_acc  # the interpreter's dot: spelled out (EMULATE)

# One tiling for every call (see the contract). 64 x 64 output tiles keep a decode step's GEMMs
# (M of 1-64) spread over many programs; K in steps of 64. Not tuned: no GPU was available here.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_WARPS, NUM_STAGES = 4, 3
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # tl.dot's; float64 is not covered


@triton.jit
def _matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, k_span,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_oc, stride_om,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    chunk = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    first = chunk * k_span  # this chunk's K range: [first, first + k_span)
    x_tile = x_ptr + rows[:, None] * stride_xm + (first + ks)[None, :] * stride_xk  # (BLOCK_M, BLOCK_K)
    # the weight's offsets in int64: a 152K-token LM head at hidden 16384 is past 2**31 elements
    w_tile = w_ptr + cols[None, :].to(tl.int64) * stride_wn + (first + ks)[:, None] * stride_wk  # (BLOCK_K, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_span, BLOCK_K):
        in_k = (k + ks) < k_span
        a = tl.load(x_tile, mask=(rows[:, None] < M) & in_k[None, :], other=0.0)
        b = tl.load(w_tile, mask=(cols[None, :] < N) & in_k[:, None], other=0.0)
        acc = dot_acc(a, b, acc, IEEE, EMULATE)
        x_tile += BLOCK_K * stride_xk
        w_tile += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + chunk * stride_oc + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, chunks: int = 1,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in one fixed reduction order (module docstring).

    Args:
        x: (M, K). weight: (N, K), x's dtype. bias: (N,) or None.
        chunks: 1, or C > 1 dividing K: return the (C, M, N) partial products of K's equal chunks.
        out_dtype: default x's dtype for one chunk, float32 for several.
    """
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or weight.dtype != x.dtype:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} does not match x {tuple(x.shape)} {x.dtype}")
    if chunks < 1 or K % chunks or (chunks > 1 and bias is not None):
        raise ValueError(f"{chunks} chunks of the input dim {K}{' with a bias' if bias is not None else ''}")
    if x.dtype not in DTYPES:
        raise ValueError(f"invariant_matmul takes {', '.join(map(str, DTYPES))}, not {x.dtype}")
    if out_dtype is None:
        out_dtype = x.dtype if chunks == 1 else torch.float32
    out = torch.empty((chunks, M, N), dtype=out_dtype, device=x.device)
    if M == 0:
        return out[0] if chunks == 1 else out
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), chunks)
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else x, out,
        M, N, K // chunks,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, EMULATE=INTERPRETED,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out[0] if chunks == 1 else out
