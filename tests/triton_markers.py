"""What the Triton kernel tests share: the skip markers, the device their tensors live on (conftest.py
puts Triton's CPU interpreter in place where there is no GPU), and the GEMM kernels' data and tolerance."""

from __future__ import annotations

import importlib.util

import pytest
import torch

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton is not installed (optional GPU extra)")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def gemm_data(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    """(x (m, k), weight (n, k), bias (n,)) of standard normals in ``dtype`` on ``DEV``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    w = torch.randn(n, k, generator=g).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV)
    return x, w, b


def gemm_tol(dtype: torch.dtype, k: int = 0) -> dict:
    """A GEMM kernel against torch's (another summation order): float32 accumulation's error, and bf16's. A
    sum over ``k`` products of standard normals rounds partial sums of size ~sqrt(k), so an output near 0
    can be off by far more than its own size times eps: the float32 bound grows with ``k`` (3e-7 k: a
    sequential float32 walk over the 8B down projection's 14,336 products was simulated 1.8e-3 off)."""
    if dtype == torch.float32:
        return dict(atol=max(1e-4, 3e-7 * k), rtol=1e-5)
    return dict(atol=0.5, rtol=1.6e-2)
