"""Programmatic dependent launch (PDL): a decode step's next kernel starts while this one finishes.

At batch 1 a decode step is hundreds of kernels in a row (398 on the fourth H100 run), each a few to
80 us, and every boundary costs the step twice: the next kernel's programs are placed only once the
last program before them exits, and each then waits a whole DRAM latency for its first weight tile
while the bandwidth the previous kernel's tail left idle stays idle. On Hopper (sm_90) a kernel launched with
PDL may be placed as soon as every program of the kernel before it has said so
(``griddepcontrol.launch_dependents``); it then waits (``griddepcontrol.wait``) until that kernel has
finished and its writes are visible. Before the wait it may only read what no kernel of the step
writes: a GEMM asks L2 for the start of its weight slab there (``prefetch_l2``), so its first steps
hit L2. FlashInfer's norm kernels offer the same launch (their ``enable_pdl`` flag).

Contract of a kernel that takes ``PDL`` (a compile-time flag): it calls ``pdl_wait(PDL)`` before it
reads anything another kernel may have written and before it writes anything; before that call it
reads weights only, through ``prefetch_l2`` (no value comes back: L2 is where every SM's writes meet,
so a prefetched line is never stale). After the wait it runs as without PDL: the values do not change,
only where the kernel's first programs start. A kernel launched without PDL after one launched with it
waits for it wholly, as always, so PDL and plain kernels mix in any order.

Asked for per call site by ``programmatic_launch`` (the engine's ``PAT_PDL``, pat_engine/env.py);
``pdl_options`` gives a wrapper its launch arguments: PDL only on an sm_90+ CUDA device, with a Triton
that compiles ``griddepcontrol`` and launches with the attribute, never under the interpreter (which
has no ``griddepcontrol``). Off by default until a GPU run times the step ahead
(bench/gpucheck/kernels.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from pat_kernels.triton_support import INTERPRETED

try:  # the griddepcontrol instructions and the launch attribute (Triton 3.9 has both; an older one may not)
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    TRITON_HAS_PDL = "launch_pdl" in CUDAOptions.__dataclass_fields__
except (ImportError, AttributeError):  # an older Triton, or one without the NVIDIA backend
    TRITON_HAS_PDL = False

    @triton.jit
    def gdc_wait():  # never compiled: PDL is never asked of a Triton without it (pdl_options)
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

_ASKED = contextvars.ContextVar("pat_kernels_programmatic_launch", default=False)


@contextlib.contextmanager
def programmatic_launch(on: bool = True) -> Iterator[None]:
    """Kernels launched inside (and CUDA graphs captured inside) use PDL where ``on`` and the device can."""
    token = _ASKED.set(on)
    try:
        yield
    finally:
        _ASKED.reset(token)


@functools.lru_cache(maxsize=8)
def device_supports(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch with PDL: an sm_90+ NVIDIA device (ROCm's "cuda" devices have no
    griddepcontrol), this Triton, no interpreter."""
    if device.type != "cuda" or INTERPRETED or not TRITON_HAS_PDL or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_options(device: torch.device) -> dict:
    """A wrapper's launch keywords for a kernel with a ``PDL`` flag: PDL inside ``programmatic_launch`` on a
    device that supports it, else the plain launch."""
    if _ASKED.get() and device_supports(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With ``PDL``: wait until the kernel before has finished and its writes are visible, then let the next
    kernel's programs be placed (they wait here in turn). Nothing without."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask L2 for the 32-byte sectors at ``ptrs`` where ``mask``: no value comes back and nothing waits."""
    tl.inline_asm_elementwise("@$2 prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l,b", [ptrs, mask],
                              dtype=tl.int32, is_pure=False, pack=1)
