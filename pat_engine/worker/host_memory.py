"""Large host buffers stay mapped between decode steps (glibc's allocator, CPU workers).

glibc serves every allocation above 32 MiB (its largest mmap threshold) with a fresh ``mmap`` and
unmaps it on free, so a step's large buffers are faulted in page by page, zeroed by the kernel,
every step: the logits of a 96-row batch at Qwen's 151,936-token vocabulary (58 MB) alone cost
about 14,000 page faults a step (bench/results/host_heap.md). ``keep_freed_memory`` makes the
worker's allocations come from the heap (``M_MMAP_MAX = 0``) and leaves freed memory there
(``M_TRIM_THRESHOLD`` at its maximum), so the next step reuses the same pages.

Memory the engine gives back on purpose still goes back: ``give_back`` (``malloc_trim(0)``: the
free top of the heap and every free page inside it) runs after a memory release (sleep) and
after a layout switch. ``PAT_HOST_HEAP=trim`` keeps glibc's defaults. Elsewhere than glibc on
Linux both calls do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

from pat_engine import env

_M_TRIM_THRESHOLD = -1  # mallopt parameters, <malloc.h>
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Serve this process's allocations from a heap that is not trimmed on free; whether it took."""
    libc = _glibc()
    if libc is None or not env.keep_host_heap():
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX))


def give_back() -> None:
    """Return the heap's free pages to the OS (after releasing memory on purpose)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
