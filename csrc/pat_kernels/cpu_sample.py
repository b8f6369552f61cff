"""The CPU sampling kernel (``cpu/sample.cpp``): inverse CDF in token-id order, one row per thread.
Built by ``cpu_extension``. ``PAT_CPU_SAMPLER=torch`` turns it off (for A/B runs:
``cpu_extension.switched_on``); pat_engine/sampling/inverse_cdf.py then computes the same bits with torch ops.
"""

from __future__ import annotations

import torch

from pat_kernels import cpu_extension

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
ENV_SWITCH = "PAT_CPU_SAMPLER"


def usable(x: torch.Tensor) -> bool:
    """Whether the kernel serves ``x``: a CPU tensor of a supported dtype, the switch on, the library built."""
    return cpu_extension.serves(x, DTYPES, ENV_SWITCH)


def inverse_cdf(x: torch.Tensor, inv_temp: torch.Tensor, floor: torch.Tensor, u: torch.Tensor,
                draw: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, z of the token, Z) per row; see cpu/sample.cpp. Call only where ``usable(x)``."""
    return torch.ops.pat_kernels.inverse_cdf_cpu(x, inv_temp, floor, u, draw)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (int64); see cpu/sample.cpp. Call only where ``usable(x)``."""
    return torch.ops.pat_kernels.argmax_cpu(x)


def weights(x: torch.Tensor, inv_temp: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """Every token's weight (float32, like x's shape); see cpu/sample.cpp. Call only where ``usable(x)``."""
    return torch.ops.pat_kernels.weights_cpu(x, inv_temp, floor)


def inverse_cdf_prefix(x: torch.Tensor, inv_temp: torch.Tensor, floor: torch.Tensor, u: torch.Tensor,
                       top_k: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draw among each row's top_k / top_p prefix; see cpu/sample.cpp. Call only where ``usable(x)``."""
    return torch.ops.pat_kernels.inverse_cdf_prefix_cpu(x, inv_temp, floor, u, top_k, top_p)
