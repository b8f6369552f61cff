"""The ``PAT_*`` environment switches pat_engine reads: each one's name, default and effect, in one place.

Every reader goes through the typed accessors below. They read the environment on every call,
never caching: benchmarks flip a switch between A/B runs in one process, tests monkeypatch it,
and worker processes inherit the driver's environment. A leaf module (it imports nothing of
pat_engine), so any layer may read it; it also answers where a Triton kernel can run
(``triton_runs_on``: Triton's interpreter is itself an environment variable).

The CPU kernel switches ``PAT_CPU_ATTENTION``, ``PAT_CPU_NORM``, ``PAT_CPU_ROTARY``,
``PAT_CPU_CHUNK_GEMM``, ``PAT_CPU_MOE`` and ``PAT_CPU_ACTIVATION`` (``torch`` turns a kernel family off) belong
to ``pat_kernels`` (``csrc/pat_kernels/cpu_extension.py``), which pat_engine imports and which imports nothing of
pat_engine.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvSwitch:
    name: str
    default: str
    effect: str

    def value(self) -> str:
        """The current value, the default when unset."""
        return os.environ.get(self.name, self.default)

    def says(self, word: str) -> bool:
        """Whether the value says ``word`` (case and surrounding spaces ignored)."""
        return self.value().strip().lower() == word


CPU_GEMM = EnvSwitch("PAT_CPU_GEMM", "onednn",
                     "torch: float32 CPU linear layers multiply the plain weights (F.linear) instead of "
                     "oneDNN-packed copies; saves the packed copy's memory (model/cpu_gemm.py)")
CPU_COLLECTIVES = EnvSwitch("PAT_CPU_COLLECTIVES", "shm",
                            "gloo: CPU TP collectives between ranks on one host go through gloo instead of "
                            "shared memory (parallel/shm_collectives.py)")
API_KEY = EnvSwitch("PAT_API_KEY", "",
                    "pat-serve's API key when --api-key is not given; empty: no key asked (serve/cli.py)")
ENGINE_CACHE = EnvSwitch("PAT_ENGINE_CACHE", "~/.cache/pat-engine",
                         "where `pat-serve demo` writes its tiny model (serve/demo.py)")
TRITON_LAYERS = EnvSwitch("PAT_TRITON_LAYERS", "auto",
                          "the Triton layer kernels (norms, rotary + KV write, SiLU-mul; model/layers/triton_ops.py): "
                          "auto: models built on CUDA; off: never (the torch formulas, for A/B runs); on: CPU models "
                          "too, run by TRITON_INTERPRET=1 (tests)")

SKINNY_GEMM = EnvSwitch("PAT_SKINNY_GEMM", "auto",
                        "auto: the LM head of bfloat16 models on CUDA multiplies steps of at most 64 rows with the "
                        "Triton skinny GEMM (pat_kernels/skinny_matmul.py), every other GEMM cuBLAS (the fourth H100 "
                        "run: the LM head at 0.91-0.97x cuBLAS's time at 1, 8 and 64 rows, the layers' projections "
                        "not ahead; bench/results/gpu_check.md, part gemm); on: every fast-numerics linear layer at "
                        "most 16 rows; a number n (1-64): at most n rows; CPU layers too under TRITON_INTERPRET=1 "
                        "(tests); off: cuBLAS everywhere")

TRITON_SAMPLER = EnvSwitch("PAT_TRITON_SAMPLER", "auto",
                           "the sampler's weights, row sums Z and draws (sampling/inverse_cdf.py) by Triton kernels "
                           "(pat_kernels/triton_sampler.py) instead of the torch twin's forty-odd kernels: the same "
                           "weights and Z, the draw's running sum in blocks (batch-invariant; docs/numerics.md). "
                           "auto: CUDA tensors (4-10x faster than the twin on the fourth H100 run, the same draws; "
                           "bench/results/gpu_check.md, part sampler); on: CPU tensors too under TRITON_INTERPRET=1 "
                           "(tests); off: the torch twin everywhere (A/B runs)")

DECODE_REDUCE = EnvSwitch("PAT_DECODE_REDUCE", "kernel",
                          "fused: the Triton decode attention's splits are merged by each (row, KV head)'s last split "
                          "to finish instead of a second kernel (pat_kernels/paged_decode_attention.py, fuse_reduce: "
                          "the same merge in the same order); kernel: the reduce kernel (the default until a GPU run "
                          "times the fused one ahead, bench/gpucheck/attention.py)")

GEMM_PROLOGUE = EnvSwitch("PAT_GEMM_PROLOGUE", "off",
                          "fused: where the skinny GEMM multiplies a step of at most 8 rows, the layer's RMSNorm (with "
                          "its residual add) and SiLU-mul run in the GEMM's prologue instead of kernels of their own "
                          "(pat_kernels/skinny_matmul.py: their values, not their launches; model/gpu_gemm.py); off: "
                          "their own kernels (the default until a GPU run times the fused step ahead, "
                          "bench/gpucheck/kernels.py)")

PDL = EnvSwitch("PAT_PDL", "off",
                "on: the Triton kernels of a step (the skinny GEMM, the layer kernels, the decode attention, greedy's "
                "first maximum) launch with programmatic dependent launch on sm_90+ GPUs: each kernel's programs are "
                "placed while the one before finishes, a GEMM's first weight steps asked of L2 meanwhile "
                "(pat_kernels/dependent_launch.py: where kernels start, not what they compute); off: plain launches "
                "(the default until a GPU run times the step ahead, bench/gpucheck/kernels.py)")

SWITCH_P2P = EnvSwitch("PAT_SWITCH_P2P", "auto",
                       "how a switch's weights and KV travel between ranks (parallel/p2p.py): auto: ranks sharing a "
                       "GPU pass their CUDA buffers by IPC handle and copy device to device, every other world "
                       "sends directly (NCCL between GPUs, gloo on the CPU); host: ranks sharing a GPU stage the "
                       "buffers through host memory and gloo instead (A/B runs); handles: every world by handle, "
                       "CPU workers through shared-memory files (tests)")

COLOCATED_COLLECTIVES = EnvSwitch("PAT_COLOCATED_COLLECTIVES", "auto",
                                  "how the TP collectives of ranks sharing a GPU travel (parallel/ipc_collectives.py): "
                                  "auto: through each other's device memory, mapped once by CUDA IPC handle; host: "
                                  "their CUDA tensors staged through host copies (the fourth H100 run's path: A/B "
                                  "runs, and the fallback should the IPC path fail on a device); ipc: CPU workers "
                                  "too, their slots in shared-memory files (tests)")

FUSED_MOE = EnvSwitch("PAT_FUSED_MOE", "auto",
                      "the routed experts of fast-numerics MoE layers (model/layers/moe.py) by the fused Triton "
                      "kernels (pat_kernels/fused_moe.py: routing grouped on the device, no host sync, so CUDA graphs "
                      "capture the layer) instead of one torch pass per expert with the routing read on the host "
                      "(eager decode). auto: models built on CUDA; on: CPU models too under TRITON_INTERPRET=1 "
                      "(tests); off: the per-expert path everywhere (A/B runs)")

SWITCHES = (CPU_GEMM, CPU_COLLECTIVES, API_KEY, ENGINE_CACHE, TRITON_LAYERS, SKINNY_GEMM, TRITON_SAMPLER,
            DECODE_REDUCE, GEMM_PROLOGUE, PDL, SWITCH_P2P, COLOCATED_COLLECTIVES, FUSED_MOE)


def cpu_gemm_packing() -> bool:
    """False when ``PAT_CPU_GEMM=torch``."""
    return not CPU_GEMM.says("torch")


def shm_collectives() -> bool:
    """False when ``PAT_CPU_COLLECTIVES=gloo``."""
    return not CPU_COLLECTIVES.says("gloo")


def api_key() -> str | None:
    """``PAT_API_KEY`` as given (no key: None)."""
    return API_KEY.value() or None


def engine_cache() -> Path:
    """``PAT_ENGINE_CACHE``, ``~`` expanded."""
    return Path(ENGINE_CACHE.value()).expanduser()


def triton_layers() -> str:
    """``PAT_TRITON_LAYERS``: "auto", "off" or "on" (anything else reads as "auto")."""
    value = TRITON_LAYERS.value().strip().lower()
    return value if value in ("off", "on") else "auto"


SKINNY_DEFAULT_ROWS, SKINNY_MOST_ROWS = 16, 64  # "on"; the kernel's limit


def skinny_gemm_rows() -> int | None:
    """``PAT_SKINNY_GEMM`` as a row count for every fast-mode GEMM: "on" 16, a whole number clamped to 0-64,
    "off" 0; None for "auto" (the default, and anything else): model/gpu_gemm.py's rule decides per layer."""
    value = SKINNY_GEMM.value().strip().lower()
    if value == "on":
        return SKINNY_DEFAULT_ROWS
    if value == "off":
        return 0
    return min(int(value), SKINNY_MOST_ROWS) if value.isdigit() else None


def fused_decode_reduce() -> bool:
    """Whether ``PAT_DECODE_REDUCE=fused`` asks the Triton decode attention to merge its splits in the split
    kernel itself."""
    return DECODE_REDUCE.says("fused")


def gemm_prologue_fused() -> bool:
    """Whether ``PAT_GEMM_PROLOGUE=fused`` asks the skinny GEMM to compute its input's norm or SiLU-mul."""
    return GEMM_PROLOGUE.says("fused")


def pdl_asked(device_type: str) -> bool:
    """Whether ``PAT_PDL=on`` asks a model on this device type to launch its Triton kernels with PDL (CUDA only;
    the kernels package decides whether the device and Triton can)."""
    return PDL.says("on") and device_type == "cuda" and triton_runs_on(device_type)


def switch_p2p() -> str:
    """``PAT_SWITCH_P2P``: "auto", "host" or "handles" (anything else reads as "auto")."""
    value = SWITCH_P2P.value().strip().lower()
    return value if value in ("host", "handles") else "auto"


def colocated_collectives() -> str:
    """``PAT_COLOCATED_COLLECTIVES``: "auto", "host" or "ipc" (anything else reads as "auto")."""
    value = COLOCATED_COLLECTIVES.value().strip().lower()
    return value if value in ("host", "ipc") else "auto"


def triton_sampler(device_type: str) -> bool:
    """Whether ``PAT_TRITON_SAMPLER`` asks for the Triton sampler kernels on this device type: "auto" (the
    default, or anything but "on" and "off") on CUDA only, "on" wherever Triton runs, "off" nowhere."""
    value = TRITON_SAMPLER.value().strip().lower()
    if value == "off":
        return False
    return triton_runs_on(device_type) and (value == "on" or device_type == "cuda")


def fused_moe(device_type: str) -> bool:
    """Whether ``PAT_FUSED_MOE`` asks for the fused Triton experts on this device type: "auto" (the default, or
    anything but "on" and "off") on CUDA only, "on" wherever Triton runs, "off" nowhere."""
    value = FUSED_MOE.value().strip().lower()
    if value == "off":
        return False
    return triton_runs_on(device_type) and (value == "on" or device_type == "cuda")


def triton_interpreted() -> bool:
    """Whether Triton runs kernels on the CPU through its interpreter (``TRITON_INTERPRET=1``: Triton's own
    variable, read here so that every layer asks one place)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(device_type: str) -> bool:
    """Whether a Triton kernel can take tensors of this device type: Triton importable, and CUDA, or the
    CPU under the interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device_type == "cuda" or (device_type == "cpu" and triton_interpreted())
