"""The Triton layer kernels (``pat_kernels/triton_{norm,rotary,activation}.py``): when they run.

On a GPU a decode step's time between the GEMMs is kernel launches: as torch ops, RMSNorm is
seven kernels, rotary eight, plus casts, residual adds and the KV ``index_copy``. With these
kernels a layer is: add + RMSNorm, QKV GEMM, (q/k norm +) rotary + KV write, attention, o GEMM,
add + RMSNorm, gate/up GEMM, SiLU-mul, down GEMM. Each kernel computes the torch formula's
operations with the same roundings (see each kernel's header), row by row.

They serve a model whose parameters live on a CUDA device, in float16, bfloat16 or float32, when
Triton imports. ``PAT_TRITON_LAYERS=off`` turns them off (the torch formulas run: A/B runs, the
fused-vs-unfused GPU test); ``on`` runs them on CPU tensors too, under ``TRITON_INTERPRET=1`` (tests).
The choice is made once, when a layer is built (``serves``), not per call. Here too: whether a model's
step launches these kernels (and the skinny GEMM, the decode attention, greedy's first maximum) with
programmatic dependent launch (``PAT_PDL``; ``launches_with_pdl``, ``launch_policy``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pat_engine import env

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TritonKernels:
    """The entry points a layer calls (see the kernels' headers for their contracts)."""

    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    rotary_kv_write: Callable[..., torch.Tensor]


def serves(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether layers built for ``device`` and ``dtype`` run the Triton kernels (on the CPU: asked for with
    ``PAT_TRITON_LAYERS=on``, and only under the interpreter, where a CPU tensor can enter a kernel)."""
    device = torch.device(device)
    mode = env.triton_layers()
    if mode == "off" or dtype not in DTYPES or (device.type == "cpu" and mode != "on"):
        return False
    return env.triton_runs_on(device.type)


def kernels_for(device: torch.device | str, dtype: torch.dtype) -> TritonKernels | None:
    """The kernels for layers built on ``device`` in ``dtype``; None where they do not serve (the layers
    then run the CPU C++ kernels or the torch formulas)."""
    if not serves(device, dtype):
        return None
    from pat_kernels import triton_activation, triton_norm, triton_rotary

    return TritonKernels(triton_norm.rms_norm, triton_norm.add_rms_norm, triton_activation.silu_and_mul,
                         triton_rotary.rotary_kv_write)


def pdl_possible(device: torch.device) -> bool:
    """Whether Triton kernels on ``device`` can launch with PDL (an sm_90+ NVIDIA GPU, a Triton with
    ``launch_pdl``); False where Triton cannot take the device's tensors."""
    if device.type != "cuda" or not env.triton_runs_on(device.type):
        return False
    from pat_kernels.dependent_launch import device_supports

    return device_supports(device)


def launches_with_pdl(device: torch.device) -> bool:
    """Whether a model on ``device`` launches its step's Triton kernels with PDL: asked for (``PAT_PDL=on``, CUDA
    only) and possible there (``pdl_possible``). Asked for but not possible: a warning, and plain launches."""
    if not env.pdl_asked(device.type):
        return False
    if not pdl_possible(device):
        log.warning("PAT_PDL=on: %s cannot launch with programmatic dependent launch (it needs an sm_90+ GPU and "
                    "a Triton with launch_pdl); its kernels launch plainly", device)
        return False
    return True


def launch_policy(pdl: bool) -> contextlib.AbstractContextManager:
    """The Triton kernels launched inside (the skinny GEMM, the layer kernels, the decode attention, greedy's
    first maximum) use programmatic dependent launch where ``pdl`` (``PAT_PDL``) and the device can: where
    each kernel starts, not what it computes (``pat_kernels/dependent_launch.py``). Nothing is imported
    without ``pdl``."""
    if not pdl:
        return contextlib.nullcontext()
    from pat_kernels.dependent_launch import programmatic_launch

    return programmatic_launch(True)
