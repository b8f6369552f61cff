"""The Triton GEMMs of CUDA linear layers, imported on first use so that neither Triton nor the kernels
package is needed to import the model (the CPU calls them only under Triton's interpreter, in tests):

- the invariant numerics mode's GEMM: the fixed-tiling kernel (``pat_kernels/invariant_matmul.py``);
- the fast mode's GEMM of a step with few rows, ``PAT_SKINNY_GEMM`` (``pat_kernels/skinny_matmul.py``).
"""

from __future__ import annotations

import torch

from pat_engine import env

SKINNY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def skinny_rows(device: torch.device | str, dtype: torch.dtype) -> int:
    """The most rows of a step that fast-mode layers built for ``device`` and ``dtype`` multiply with the
    skinny GEMM (``PAT_SKINNY_GEMM``: "on" is 16, or a number up to 64); 0 when it does not serve: not asked
    for, Triton missing, not a ``tl.dot`` dtype, or neither a CUDA device nor the CPU under Triton's
    interpreter. Decided once, when a layer is built."""
    rows = env.skinny_gemm_rows()
    if not rows or dtype not in SKINNY_DTYPES:
        return 0
    return rows if env.triton_runs_on(torch.device(device).type) else 0


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for at most 64 rows, the weight streamed by many programs (see the kernel)."""
    from pat_kernels.skinny_matmul import skinny_matmul as kernel

    return kernel(x, weight, bias)
