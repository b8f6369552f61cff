"""The CPU GEMM of decode steps of a few rows (``cpu/skinny_gemm.cpp``): each weight row read once, from the
plain weight, each output in one fixed float32 sequence (see the .cpp). Built by ``cpu_extension``;
``PAT_CPU_SKINNY_GEMM=torch`` turns it off (for A/B runs: ``cpu_extension.switched_on``): oneDNN's pack serves
then.
"""

from __future__ import annotations

import torch

from pat_kernels import cpu_extension

DTYPES = (torch.float32, torch.bfloat16)
ENV_SWITCH = "PAT_CPU_SKINNY_GEMM"
MAX_ROWS = 8  # kMaxRows in the .cpp
_NO_BIAS = {dtype: torch.empty(0, dtype=dtype) for dtype in DTYPES}  # what the op takes for "no bias"


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel serves ``x @ weight.T``: 1 to MAX_ROWS rows, one dtype, a contiguous weight, the switch
    on, the library built."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.dtype == x.dtype and weight.is_contiguous()
            and cpu_extension.serves(x, DTYPES, ENV_SWITCH))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in x's dtype; call only where ``usable``."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return torch.ops.pat_kernels.skinny_linear_cpu(x, weight, _NO_BIAS[x.dtype] if bias is None else bias.contiguous())
