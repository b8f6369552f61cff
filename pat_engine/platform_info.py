"""What machine this is, in the words that benchmark results and profile tables record."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path


@functools.lru_cache(maxsize=None)
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def machine_summary() -> str:
    """One line for a result file: CPU model and cores, the GPU if any, Python and torch versions."""
    import torch

    gpu = gpu_name()
    gpu_part = f", GPU {gpu}" if gpu else ", no GPU"
    return (f"{cpu_name()}, {os.cpu_count()} cores{gpu_part}, Python {platform.python_version()}, "
            f"torch {torch.__version__}")
