"""The parts of the GPU check, in run and report order. A new part is one module under ``gpucheck/`` with
``run(ctx: shared.Ctx) -> report.PartResult`` and one entry here.

Expected seconds are for an H100 80GB (16 CPU cores), each part in its own process, its start-up (imports,
CUDA, Triton compiles on a fresh machine) and its weight loads included; the checkpoint is written before
the first part that needs one (``CHECKPOINT_S``, once per workdir). The --quick ones are what the second
H100 run took on a fresh machine (bench/results/gpu_2026-11-26_h100_second_run/: 9, 14-20, 17, 30, 22 and
36 s), rounded up; the others are that run's or the first run's, or estimates where a part has not run
in full (the four-rank switch). Timeouts end a part's process (and what it started); the part is then
recorded as failed and the next one runs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Part:
    name: str  # what --only takes
    title: str
    module: str  # gpucheck.<module>.run(ctx) -> PartResult
    quick_s: int | None  # expected seconds under --quick; None: --quick skips the part
    full_s: int  # expected seconds without --quick
    quick_timeout_s: int
    full_timeout_s: int
    needs_checkpoint: bool = True  # the 16 GB random Llama-3-8B-shaped checkpoint

    def runner(self) -> Callable:
        return importlib.import_module(f"gpucheck.{self.module}").run


PARTS: tuple[Part, ...] = (
    Part("attention", "Decode attention vs SDPA on contiguous K/V, and the fused layer kernels", "attention",
         15, 30, 120, 300, needs_checkpoint=False),
    # gemm, sampler: estimates (not run on a device yet), short timeouts so that a hang in new code leaves the
    # parts after them their time. gemm --quick compiles a few dozen kernel variants (its sweep's configs x row tiles)
    Part("gemm", "Decode GEMMs at 1-64 rows: cuBLAS beside the skinny Triton GEMM", "skinny_gemm", 40, 90, 100, 360,
         needs_checkpoint=False),
    Part("sampler", "The RL draw: temperature 1 with log-probs, the torch twin beside the Triton kernels", "sampler",
         30, 45, 75, 240, needs_checkpoint=False),
    Part("kernels", "Kernels per decode step (torch.profiler, Llama-3-8B shape, bf16)", "kernels",
         35, 50, 180, 400),  # 18 s on the third run; since: the skinny GEMM's mode and a graphs-step profile
    Part("prefill", "Packed varlen prefill vs the measured bf16 GEMM throughput", "prefill", 25, 40, 150, 300),
    Part("decode", "TP1 decode vs the HBM roofline and the streamed-bytes floor", "decode", 70, 200, 200, 560),
    Part("profile", "pat-profile --emulate-world 8 (graphs on, median step)", "emulated_profile", 40, 40, 150, 480),
    Part("controller", "The controller on ranks sharing the GPU: the predictor's step error, its choices",
         "switch_controller", None, 150, 300, 300, needs_checkpoint=False),  # estimate: pat-profile ~60 s + 2 rounds
    Part("switch", "The live switch on one GPU, ranks sharing it: phases, collectives", "switch",
         45, 200, 150, 560, needs_checkpoint=False),  # writes its own 2.5 GB checkpoint (1B shape)
    Part("graphs", "CUDA graph capture and recapture", "graphs", None, 25, 120, 300),
    Part("weightsync", "Weight sync", "weightsync", None, 60, 120, 400),
    Part("tests", "gpu-marked tests", "gpu_tests", 170, 400, 240, 480),  # --quick: gpu_tests.QUICK; full: over 200 s
    Part("invariant", "Invariant numerics' cost per decode step (issue 31)", "invariant", None, 25, 180, 300),
)
NAMES = tuple(p.name for p in PARTS)
CHECKPOINT_S, CHECKPOINT_TIMEOUT_S = 20, 300  # writing the 16 GB checkpoint: 17 s on the second H100 run (reused: ~0)


def part(name: str) -> Part:
    for p in PARTS:
        if p.name == name:
            return p
    raise KeyError(f"no GPU check part named {name!r} (parts: {', '.join(NAMES)})")
