"""The invariant numerics mode's GEMM on CUDA: the fixed-tiling Triton kernel
(``pat_kernels/invariant_matmul.py``), imported on first use so that neither Triton nor the
kernels package is needed to import the model (the CPU never calls it)."""

from __future__ import annotations

import torch


def covers(x: torch.Tensor) -> bool:
    """Whether the invariant GEMM multiplies ``x``: CUDA tensors other than float64 (tl.dot has no float64;
    float64 is not claimed invariant, docs/numerics.md)."""
    return x.is_cuda and x.dtype != torch.float64


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, chunks: int = 1,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with one reduction order per output element whatever the row count;
    ``chunks`` > 1: the (chunks, M, N) partials of the input dim's equal chunks (see the kernel)."""
    from pat_kernels.invariant_matmul import invariant_matmul as kernel

    return kernel(x, weight, bias, chunks=chunks, out_dtype=out_dtype)
