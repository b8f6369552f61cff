"""The CPU paged attention kernels, built by ``cpu_extension``: decode attention over the block pool
(``cpu/paged_decode_attention.cpp``) and the store of new tokens' K/V into it (``cpu/kv_write.cpp``).

``PAT_CPU_ATTENTION=torch`` turns both off (for A/B runs: ``cpu_extension.switched_on``).
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


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> bool:
    """Store the first ``len(slots)`` tokens of k/v (T, kvh, hd) at ``slots`` of ``kv_cache``
    with the kernel; False (nothing written) where it does not serve these tensors."""
    if not (kv_cache.is_contiguous() and slots.dtype == torch.long and slots.is_contiguous()
            and all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (k, v))
            and cpu_extension.serves(kv_cache, DTYPES, ENV_SWITCH)):
        return False
    torch.ops.pat_kernels.write_kv_cpu_(kv_cache, k, v, slots)
    return True
