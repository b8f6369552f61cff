"""Loader of the CPU paged decode attention kernel (``cpu/paged_decode_attention.cpp``).

The C++ source is compiled on first use with ``torch.utils.cpp_extension.load`` and cached under
the torch extensions directory (``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), in a
folder whose name carries the Python and torch versions and the instruction set it was built for
(``-mavx2 -mfma``, AVX-512 or none, after ``torch.backends.cpu.get_cpu_capability()``): a cache
built on another machine is never loaded where its instructions are missing.

Concurrent builds (threads, or worker processes starting together) are serialised by an
``fcntl`` lock on the build folder; holding it, a leftover torch ``lock`` file (from a build that
was killed, which would make torch wait forever) is removed before loading.

``PAT_CPU_ATTENTION=torch`` turns the kernel off (read on every call, for A/B runs). Where the
build fails, the torch path serves and one warning names the reason.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "cpu" / "paged_decode_attention.cpp"
DTYPES = (torch.float32, torch.float64, torch.bfloat16)
ENV_SWITCH = "PAT_CPU_ATTENTION"  # "torch": use the torch path; anything else (or unset): the kernel

DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]

_lock = threading.Lock()
_kernel: DecodeKernel | None = None
_failed: str | None = None  # why the build failed, once it has
build_seconds: float | None = None  # time of this process's load (compile included if it had to build)

# torch's capability name -> (tag, compiler flags). Explicit flags rather than -march=native, so the
# code uses exactly the instructions that the cache folder's name promises.
_ISA_FLAGS = {
    "AVX512": ("avx512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"]),
    "AVX2": ("avx2", ["-mavx2", "-mfma"]),
}


def isa() -> tuple[str, list[str]]:
    """The instruction-set tag and flags to build for on this CPU."""
    return _ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), ("generic", []))


def extension_name() -> str:
    tag, _ = isa()
    version = re.sub(r"[^0-9a-zA-Z]+", "_", torch.__version__)
    return f"pat_cpu_attention_{tag}_py{sys.version_info.major}{sys.version_info.minor}_torch{version}"


def build_directory() -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / extension_name()


def _build() -> DecodeKernel:
    import fcntl

    from torch.utils.cpp_extension import load

    tag, flags = isa()
    folder = build_directory()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "pat.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the OS if this process dies
        try:
            (folder / "lock").unlink(missing_ok=True)  # torch's baton: only a dead build leaves it here now
            load(name=extension_name(), sources=[str(SOURCE)], build_directory=str(folder),
                 extra_cflags=["-O3", "-fopenmp", *flags], extra_ldflags=["-fopenmp"],
                 is_python_module=False, verbose=False)
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
    return torch.ops.pat_kernels.paged_decode_attention_cpu


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "kernel").strip().lower() != "torch"


def load_kernel() -> DecodeKernel | None:
    """The compiled kernel (built on the first call), or None where it cannot be built."""
    global _kernel, _failed, build_seconds
    if _kernel is not None or _failed is not None:
        return _kernel
    with _lock:
        if _kernel is None and _failed is None:
            start = time.perf_counter()
            try:
                _kernel = _build()
                build_seconds = time.perf_counter() - start
            except Exception as e:  # no compiler, no ninja, a compile error: the torch path serves
                first_line = (str(e).strip().splitlines() or [""])[0][:300]
                _failed = f"{type(e).__name__}: {first_line}"
                log.debug("CPU attention build output:\n%s", e)
                log.warning("CPU paged attention kernel unavailable, using the torch path (%s)", _failed)
    return _kernel


def cpu_decode_kernel(dtype: torch.dtype) -> DecodeKernel | None:
    """The kernel for ``dtype`` when it is on, supported and built; else None (use the torch path).

    Called as ``kernel(q, kv_cache, block_tables, context_lens, scale)``.
    """
    if dtype not in DTYPES or not enabled():
        return None
    return load_kernel()
