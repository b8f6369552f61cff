"""The parts of the GPU check, in run and report order. A new part is one module under ``gpucheck/`` with
``run(ctx: shared.Ctx) -> report.PartResult`` and one entry here.

Expected seconds are for an H100 80GB (16 CPU cores), each part in its own process, its start-up (imports,
CUDA, Triton compiles on a fresh machine) and its weight loads included; the checkpoint is written before
the first part that needs one (``CHECKPOINT_S``, once per workdir). They are estimates from the first H100
run (bench/results/gpu_2026-11-26_h100_first_run/), to be replaced by what the parts table of the next GPU
run shows. Timeouts end a part's process (and what it started); the part is then recorded as failed and the
next one runs.
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
         35, 60, 120, 300, needs_checkpoint=False),
    Part("kernels", "Kernels per decode step (torch.profiler, Llama-3-8B shape, bf16)", "kernels",
         65, 90, 180, 400),
    Part("prefill", "Packed varlen prefill vs the measured bf16 GEMM throughput", "prefill", 40, 60, 150, 300),
    Part("decode", "TP1 decode vs the HBM roofline and the streamed-bytes floor", "decode", 75, 150, 180, 480),
    Part("profile", "pat-profile --emulate-world 8 (graphs on, median step)", "emulated_profile", 50, 60, 150, 480),
    Part("graphs", "CUDA graph capture and recapture", "graphs", None, 30, 120, 300),
    Part("weightsync", "Weight sync", "weightsync", None, 60, 120, 400),
    Part("tests", "gpu-marked tests", "gpu_tests", None, 70, 120, 480),
    Part("invariant", "Invariant numerics' cost per decode step (issue 31)", "invariant", None, 90, 180, 300),
)
NAMES = tuple(p.name for p in PARTS)
CHECKPOINT_S, CHECKPOINT_TIMEOUT_S = 30, 300  # writing the 16 GB checkpoint (reused: ~0)


def part(name: str) -> Part:
    for p in PARTS:
        if p.name == name:
            return p
    raise KeyError(f"no GPU check part named {name!r} (parts: {', '.join(NAMES)})")
