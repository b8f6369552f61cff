"""The Triton GEMMs of CUDA linear layers, imported on first use so that neither Triton nor the kernels
package is needed to import the model (the CPU calls them only under Triton's interpreter, in tests):

- the invariant numerics mode's GEMM: the fixed-tiling kernel (``pat_kernels/invariant_matmul.py``);
- the fast mode's GEMM of a step with few rows, ``PAT_SKINNY_GEMM=on`` (``pat_kernels/skinny_matmul.py``).
"""

from __future__ import annotations

import importlib.util

import torch

from pat_engine import env

SKINNY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SKINNY_MAX_ROWS = 16  # pat_kernels.skinny_matmul.MAX_ROWS (the kernels package is not imported here)


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


def skinny_serves(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether fast-mode layers built for ``device`` and ``dtype`` multiply few-row steps with the skinny
    GEMM: asked for (``PAT_SKINNY_GEMM=on``), Triton importable, a ``tl.dot`` dtype, and a CUDA device or
    the CPU under Triton's interpreter. Decided once, when a layer is built."""
    device = torch.device(device)
    if not env.skinny_gemm() or dtype not in SKINNY_DTYPES or importlib.util.find_spec("triton") is None:
        return False
    from pat_engine.model.layers.triton_ops import interpreting

    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def skinny_takes(x: torch.Tensor) -> bool:
    """Whether a layer that ``skinny_serves`` multiplies this ``x`` with the skinny GEMM: 1 to 16 rows."""
    return x.dim() == 2 and 0 < x.shape[0] <= SKINNY_MAX_ROWS


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for at most 16 rows, the weight streamed by many programs (see the kernel)."""
    from pat_kernels.skinny_matmul import skinny_matmul as kernel

    return kernel(x, weight, bias)
