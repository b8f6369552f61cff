"""What the results file says about the machine, from a fresh process (``python -m gpucheck.environment``
prints it as JSON): the driver itself never imports torch or touches the GPU, so it holds no device memory
while the parts run, and importing ``pat_engine`` here shows which serving extras it pulls in."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys

EXTRAS = ("fastapi", "uvicorn", "prometheus_client", "ray", "httpx", "starlette")


def version(mod: str) -> str:
    try:
        if importlib.util.find_spec(mod) is None:
            return "missing"
    except ImportError:
        return "missing"
    try:
        return importlib.metadata.version(mod)
    except importlib.metadata.PackageNotFoundError:
        return "present"


def describe() -> dict:
    import torch

    import pat_engine  # noqa: F401
    from pat_engine import Engine  # noqa: F401
    from pat_engine import env as pat_env
    from pat_engine.platform_info import machine_summary

    extras = sorted(m for m in EXTRAS if m in sys.modules)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    mods = ", ".join(f"{m} {version(m)}" for m in ("triton", "transformers", "safetensors", "pytest", "flashinfer"))
    switches = ", ".join(f"{s.name}={s.value()}" for s in pat_env.SWITCHES if s.name in os.environ) or "none"
    env = (f"Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), {mods}; "
           f"device {gpu or 'cpu'}. Serving extras imported by `import pat_engine; from pat_engine import Engine`: "
           f"{extras}. PAT_ switches set (pat_engine/env.py; every part and engine inherits them): {switches}.")
    return {"machine": machine_summary(), "environment": env, "gpu": gpu}


if __name__ == "__main__":
    print(json.dumps(describe()))
