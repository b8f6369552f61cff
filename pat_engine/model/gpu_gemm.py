"""The Triton GEMMs of CUDA linear layers, imported on first use so that neither Triton nor the kernels
package is needed to import the model (the CPU calls them only under Triton's interpreter, in tests):

- the invariant numerics mode's GEMM: the fixed-tiling kernel (``pat_kernels/invariant_matmul.py``);
- the fast mode's GEMM of a step with few rows, ``PAT_SKINNY_GEMM`` (``pat_kernels/skinny_matmul.py``).
  By default ("auto") only where a GPU run measured it ahead of cuBLAS: the LM head of bfloat16 models on
  CUDA, 344 against 380 us at one row, 350 / 382 at 8 and 375 / 388 at 64 for Llama-3-8B's 128256 x 4096
  on the fourth H100 run (bench/results/gpu_check.md, part gemm). The layers' projections were not ahead
  over a step (5.98 ms through it against cuBLAS's 5.74), so they stay on cuBLAS.
"""

from __future__ import annotations

import torch

from pat_engine import env

SKINNY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
AUTO_LM_HEAD_DTYPES = (torch.bfloat16,)  # measured ahead in bfloat16 only


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


def skinny_rows(device: torch.device | str, dtype: torch.dtype, lm_head: bool = False) -> int:
    """The most rows of a step that a fast-mode layer built for ``device`` and ``dtype`` (the LM head when
    ``lm_head``) multiplies with the skinny GEMM; 0: cuBLAS (or torch) always. ``PAT_SKINNY_GEMM``: "auto"
    (the default) gives the bfloat16 LM head on CUDA up to 64 rows and every other layer 0; "on" (16) or a
    number gives every layer of a ``tl.dot`` dtype that many; "off" 0. Never where Triton cannot take the
    tensors (not importable, or a CPU device outside Triton's interpreter). Decided once, when a layer is
    built."""
    asked = env.skinny_gemm_rows()
    kind = torch.device(device).type
    if asked is None:  # auto
        rows = env.SKINNY_MOST_ROWS if lm_head and kind == "cuda" and dtype in AUTO_LM_HEAD_DTYPES else 0
    else:
        rows = asked if dtype in SKINNY_DTYPES else 0
    return rows if rows and env.triton_runs_on(kind) else 0


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for at most 64 rows, the weight streamed by many programs (see the kernel)."""
    from pat_kernels.skinny_matmul import skinny_matmul as kernel

    return kernel(x, weight, bias)
