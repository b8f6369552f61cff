"""The parts of the GPU check, in run and report order. A new part is one module under ``gpucheck/`` with
``run(ctx: shared.Ctx) -> report.PartResult`` and one entry here.

Expected seconds are for an H100 80GB (16 CPU cores), each part in its own process, its start-up (imports,
CUDA, Triton compiles on a fresh machine) and its weight loads included; the checkpoint is written before
the first part that needs one (``CHECKPOINT_S``, once per workdir). The figures are what the latest H100
run of each part took on a fresh machine (the second, third or fourth run's folder under bench/results/),
rounded up; a comment names the newer ones. Timeouts end a part's process (and what it started); the part is then
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
    # gemm, sampler: 24 and 12 s on the fourth H100 run (--quick), rounded up. gemm --quick compiles a few dozen
    # kernel variants (its sweep's configs x row tiles)
    Part("gemm", "Decode GEMMs at 1-64 rows: cuBLAS beside the skinny Triton GEMM", "skinny_gemm", 30, 90, 100, 360,
         needs_checkpoint=False),
    Part("sampler", "The RL draw: temperature 1 with log-probs, the torch twin beside the Triton kernels", "sampler",
         15, 45, 75, 240, needs_checkpoint=False),
    Part("kernels", "Kernels per decode step (torch.profiler, Llama-3-8B shape, bf16)", "kernels",
         55, 75, 180, 400),  # 28 s on the fourth run with one variant; seven now (three at batch 1 only)
    Part("prefill", "Packed varlen prefill vs the measured bf16 GEMM throughput", "prefill", 25, 40, 150, 300),
    # moe: not yet run; a guess (three kernels compiled at two block sizes, a graph capture a size)
    Part("moe", "An MoE layer's experts (Qwen3-30B-A3B shape): fused Triton kernels vs per expert", "moe",
         None, 60, 180, 240, needs_checkpoint=False),
    # decode: 55 s on the fourth run (--quick); a third engine now (the candidate settings at batch 1), ~25 s more
    Part("decode", "TP1 decode vs the HBM roofline and the streamed-bytes floor", "decode", 85, 230, 230, 560),
    Part("profile", "pat-profile --emulate-world 8 (graphs on, median step)", "emulated_profile", 40, 40, 150, 480),
    # controller: 136 s on the fourth run, 64 of them its pat-profile's one pass over the grid; two passes now
    Part("controller", "The controller on ranks sharing the GPU: the predictor's step error, its choices",
         "switch_controller", None, 200, 360, 360, needs_checkpoint=False),
    Part("switch", "The live switch on one GPU, ranks sharing it: phases, collectives", "switch",
         45, 150, 150, 560, needs_checkpoint=False),  # its own 2.5 GB checkpoint (1B shape); 114 s in full, before
    # the way back with its graphs dropped (4 more batches and a KV release)
    # collectives: two spawned ranks (CUDA start-up) and a few hundred calls; not a headline of --quick
    Part("collectives", "A co-located TP2 step's collectives: through the IPC slots and host-staged",
         "collectives", None, 30, 120, 120, needs_checkpoint=False),
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
