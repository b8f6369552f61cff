"""Builds and loads the CPU kernels (every ``cpu/*.cpp``, one library registering ``torch.ops.pat_kernels``).

The C++ sources are compiled on first use with ``torch.utils.cpp_extension.load`` and cached under
the torch extensions directory (``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), in a
folder whose name carries the Python and torch versions and the instruction set it was built for
(``-mavx2 -mfma``, AVX-512 or none, after ``torch.backends.cpu.get_cpu_capability()``): a cache
built on another machine is never loaded where its instructions are missing. The folder's name also
carries a short hash of where the sources are, so two checkouts on one machine (worktrees, a clone
beside an install) each keep their build instead of rebuilding the other's on every start.

Concurrent builds (threads, or worker processes starting together) are serialised by an
``fcntl`` lock on the build folder; holding it, a leftover torch ``lock`` file (from a build that
was killed, which would make torch wait forever) is removed before loading.

Where the build fails, the torch paths serve and one warning names the reason. Each kernel family
has its own accessor and off switch: ``cpu_attention`` (``PAT_CPU_ATTENTION=torch``), ``cpu_norm``
(``PAT_CPU_NORM=torch``), ``cpu_rotary`` (``PAT_CPU_ROTARY=torch``), ``cpu_chunk_gemm``
(``PAT_CPU_CHUNK_GEMM=torch``), ``cpu_skinny_gemm``, ``cpu_sample``, ``cpu_moe`` (``PAT_CPU_MOE=torch``) and
``cpu_activation`` (``PAT_CPU_ACTIVATION=torch``). A switch is read on every call, so
that A/B runs may flip it between two steps of one process; inside ``switches_read_once`` (a model
step: the engine's worker wraps each in it) once, at its first call: a decode step asks them a few times a
layer (bench/results/cpu_switch_reads.md: 1.22x a step of a host-bound 32-layer narrow model).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).resolve().parent / "cpu").glob("*.cpp"))

_lock = threading.Lock()
_loaded = False
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
    return f"pat_cpu_kernels_{tag}_py{sys.version_info.major}{sys.version_info.minor}_torch{version}"


def build_directory() -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    checkout = hashlib.sha1(str(SOURCES[0].parent.resolve()).encode()).hexdigest()[:8]
    return Path(root) / f"{extension_name()}_{checkout}"


def _build() -> None:
    import fcntl

    from torch.utils.cpp_extension import load

    tag, flags = isa()
    folder = build_directory()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "pat.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the OS if this process dies
        try:
            (folder / "lock").unlink(missing_ok=True)  # torch's baton: only a dead build leaves it here now
            load(name=extension_name(), sources=[str(s) for s in SOURCES], build_directory=str(folder),
                 extra_cflags=["-O3", "-fopenmp", *flags], extra_ldflags=["-fopenmp"],
                 is_python_module=False, verbose=False)
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


_READ_ONCE: contextvars.ContextVar[dict[str, bool] | None] = contextvars.ContextVar("pat_kernels_switches",
                                                                                    default=None)


@contextlib.contextmanager
def switches_read_once() -> Iterator[None]:
    """Inside, each kernel family's switch is read from the environment at its first call only (a step)."""
    token = _READ_ONCE.set({})
    try:
        yield
    finally:
        _READ_ONCE.reset(token)


def switched_on(env_switch: str) -> bool:
    """A kernel family is on unless its environment switch says ``torch``."""
    read = _READ_ONCE.get()
    on = None if read is None else read.get(env_switch)
    if on is None:
        on = os.environ.get(env_switch, "kernel").strip().lower() != "torch"
        if read is not None:
            read[env_switch] = on
    return on


def serves(x: torch.Tensor, dtypes: tuple[torch.dtype, ...], env_switch: str) -> bool:
    """Whether a kernel family serves ``x``: a CPU tensor of one of its dtypes, its switch on, and
    the library built (built here on the first call)."""
    return x.device.type == "cpu" and x.dtype in dtypes and switched_on(env_switch) and load()


def load() -> bool:
    """Build (on the first call) and load the library; False where it cannot be built."""
    global _loaded, _failed, build_seconds
    if _loaded or _failed is not None:
        return _loaded
    with _lock:
        if not _loaded and _failed is None:
            start = time.perf_counter()
            try:
                _build()
                _loaded = True
                build_seconds = time.perf_counter() - start
            except Exception as e:  # no compiler, no ninja, a compile error: the torch path serves
                first_line = (str(e).strip().splitlines() or [""])[0][:300]
                _failed = f"{type(e).__name__}: {first_line}"
                log.debug("CPU kernels build output:\n%s", e)
                log.warning("CPU kernels unavailable, using the torch paths (%s)", _failed)
    return _loaded
