"""The Triton GEMMs of CUDA linear layers, imported on first use so that neither Triton nor the kernels
package is needed to import the model (the CPU calls them only under Triton's interpreter, in tests):

- the invariant numerics mode's GEMM: the fixed-tiling kernel (``pat_kernels/invariant_matmul.py``);
- the fast mode's GEMM of a step with few rows, ``PAT_SKINNY_GEMM`` (``pat_kernels/skinny_matmul.py``).
  By default ("auto") only where a GPU run measured it ahead of cuBLAS: the LM head of bfloat16 models on
  CUDA, 344 against 380 us at one row, 350 / 382 at 8 and 375 / 388 at 64 for Llama-3-8B's 128256 x 4096
  on the fourth H100 run (bench/results/gpu_check.md, part gemm). The layers' projections were not ahead
  over a step (5.98 ms through it against cuBLAS's 5.74), so they stay on cuBLAS;
- the same kernel with its input's RMSNorm or SiLU-mul in its prologue, ``PAT_GEMM_PROLOGUE=fused``, for
  the steps of at most ``PROLOGUE_MOST_ROWS`` rows of a layer the skinny GEMM serves: a batch-1 step's
  96 norm and SiLU-mul kernels (0.20 ms of GPU time on the fourth H100 run, part kernels) become part of
  the GEMMs after them. Off by default until a GPU run times the step ahead.
"""

from __future__ import annotations

import torch

from pat_engine import env

SKINNY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
AUTO_LM_HEAD_DTYPES = (torch.bfloat16,)  # measured ahead in bfloat16 only
# Every program of a prologue GEMM computes its rows' norm statistic over the whole row: the input is read
# once a program, which pays where the rows are few and the weight slab of a program is large beside them.
PROLOGUE_MOST_ROWS = 8


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


def prologue_rows(skinny_rows: int, triton_layers: bool) -> int:
    """The most rows of a step whose input's norm or SiLU-mul a fast-mode layer computes in its skinny GEMM's
    prologue (``PAT_GEMM_PROLOGUE=fused``): up to ``PROLOGUE_MOST_ROWS`` of the rows the skinny GEMM serves
    (``skinny_rows``), where the Triton layer kernels serve too (the prologue computes their values); else 0."""
    return min(skinny_rows, PROLOGUE_MOST_ROWS) if env.gemm_prologue_fused() and triton_layers else 0


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for at most 64 rows, the weight streamed by many programs (see the kernel)."""
    from pat_kernels.skinny_matmul import skinny_matmul as kernel

    return kernel(x, weight, bias)


def skinny_norm_matmul(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight.T (+ bias), x + residual), the norm in the GEMM's prologue."""
    from pat_kernels.skinny_matmul import skinny_norm_matmul as kernel

    return kernel(x, residual, norm_weight, eps, weight, bias)


def skinny_silu_matmul(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu_and_mul(gate_up) @ weight.T (+ bias)``, SiLU-mul in the GEMM's prologue."""
    from pat_kernels.skinny_matmul import skinny_silu_matmul as kernel

    return kernel(gate_up, weight, bias)
