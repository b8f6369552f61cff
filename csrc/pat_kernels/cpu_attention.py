"""The CPU paged decode attention kernel (``cpu/paged_decode_attention.cpp``), built by ``cpu_extension``.

``PAT_CPU_ATTENTION=torch`` turns it off (read on every call, for A/B runs).
"""

from __future__ import annotations

from typing import Callable

import torch

from pat_kernels import cpu_extension

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
ENV_SWITCH = "PAT_CPU_ATTENTION"  # "torch": use the torch path; anything else (or unset): the kernel

DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def load_kernel() -> DecodeKernel | None:
    """The compiled kernel (the library is built on the first call), or None where it cannot be built."""
    return torch.ops.pat_kernels.paged_decode_attention_cpu if cpu_extension.load() else None


def cpu_decode_kernel(dtype: torch.dtype) -> DecodeKernel | None:
    """The kernel for ``dtype`` when it is on, supported and built; else None (use the torch path).

    Called as ``kernel(q, kv_cache, block_tables, context_lens, scale)``.
    """
    if dtype not in DTYPES or not cpu_extension.switched_on(ENV_SWITCH):
        return None
    return load_kernel()
