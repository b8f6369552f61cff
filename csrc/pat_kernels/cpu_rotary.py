"""The CPU rotary kernel (``cpu/rotary.cpp``): rotates q and k in place in one pass, with the
torch path's rounding (so float64 keeps its bits). Built by ``cpu_extension``.

``PAT_CPU_ROTARY=torch`` turns it off (for A/B runs: ``cpu_extension.switched_on``).
"""

from __future__ import annotations

import torch

from pat_kernels import cpu_extension

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
ENV_SWITCH = "PAT_CPU_ROTARY"


def usable(x: torch.Tensor) -> bool:
    """Whether the kernel serves ``x``: a CPU tensor of a supported dtype, with the switch on and the library built."""
    return cpu_extension.serves(x, DTYPES, ENV_SWITCH)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` (tokens, heads, head_dim) in place by cos/sin (tokens, head_dim); call only where ``usable(x)``."""
    return torch.ops.pat_kernels.rotary_cpu_(x, cos, sin)
