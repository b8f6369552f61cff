"""The CPU RMSNorm kernels (``cpu/rms_norm.cpp``): one pass per row, optionally fused with the
residual add before it; float32 and bfloat16. Built by ``cpu_extension``.

float64 is left to the torch formula in ``pat_engine/model/layers/norm.py``, which mirrors
transformers' operation by operation: it is the dtype of the exactness suite, and the kernel's
vector-lane sum of squares differs in the last bit. ``PAT_CPU_NORM=torch`` turns the kernels off
(for A/B runs: ``cpu_extension.switched_on``).
"""

from __future__ import annotations

import torch

from pat_kernels import cpu_extension

DTYPES = (torch.float32, torch.bfloat16)
ENV_SWITCH = "PAT_CPU_NORM"


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels serve ``x``: a CPU tensor of a supported dtype, with the switch on and the library built."""
    return cpu_extension.serves(x, DTYPES, ENV_SWITCH)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` (rows, n) normalised and scaled by ``weight``; call only where ``usable(x)``."""
    return torch.ops.pat_kernels.rms_norm_cpu(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); call only where ``usable(x)``."""
    return torch.ops.pat_kernels.add_rms_norm_cpu(x, residual, weight, eps)
