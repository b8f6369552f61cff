"""The CPU RMSNorm kernel (fused with the residual add) against the torch formula it replaces.

    PYTHONPATH=.:profiler:integrations:csrc python bench/cpu_norm.py [--rounds 15] [--threads 2]

Two measurements, each alternating the two paths (A, B, A, B, ...; ``PAT_CPU_NORM`` switches them)
so the shared host's load hits both alike, and reporting medians:
- one call of ``RMSNorm.add_forward`` at the benchmark model's width (hidden 512), float32;
- one whole decode step of the benchmark model (bench/common.PEER_SPEC), in process, greedy, at
  batch 1, 16 and 64 (the step has 2 * layers + 1 = 9 norms).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PEER_SPEC, markdown_table, write_result  # noqa: E402
from step_breakdown import Rollout  # noqa: E402
from pat_engine.model.layers.norm import RMSNorm  # noqa: E402
from pat_engine.tiny_model import write_tiny_model  # noqa: E402
from pat_kernels import cpu_extension, cpu_norm  # noqa: E402

PATHS = ("kernel", "torch")


def alternate(rounds: int, run) -> dict[str, float]:
    """Median ms of ``run()`` per path, the paths alternating round by round."""
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    for r in range(rounds):
        for path in PATHS if r % 2 == 0 else PATHS[::-1]:
            os.environ[cpu_norm.ENV_SWITCH] = path
            times[path].append(run())
    os.environ.pop(cpu_norm.ENV_SWITCH, None)
    return {p: statistics.median(v) for p, v in times.items()}


def call_ms(rows: int, calls: int = 200) -> float:
    norm = RMSNorm(PEER_SPEC.hidden_size, 1e-6, torch.float32, "cpu")
    x, residual = torch.randn(rows, PEER_SPEC.hidden_size), torch.randn(rows, PEER_SPEC.hidden_size)
    norm.add_forward(x, residual)
    start = time.perf_counter()
    for _ in range(calls):
        norm.add_forward(x, residual)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps-per-round", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_extension.load():
        sys.exit(f"the CPU extension cannot be built: {cpu_extension._failed}")

    call_rows, step_rows = [], []
    for batch in args.batch_sizes:
        m = alternate(args.rounds, lambda: call_ms(batch))
        call_rows.append([batch, round(m["torch"] * 1e3, 1), round(m["kernel"] * 1e3, 1), f"{m['torch'] / m['kernel']:.2f}x"])
    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_model(Path(tmp), PEER_SPEC)
        for batch in args.batch_sizes:
            new_tokens = 2 * args.rounds * args.steps_per_round + 8
            run = Rollout(tmp, batch, 32, new_tokens, sampled=False)
            run.prefill()
            for _ in range(4):
                run.decode()

            def steps() -> float:
                start = time.perf_counter()
                for _ in range(args.steps_per_round):
                    run.decode()
                return (time.perf_counter() - start) / args.steps_per_round * 1e3

            m = alternate(args.rounds, steps)
            step_rows.append([batch, round(m["torch"], 2), round(m["kernel"], 2), round(m["torch"] - m["kernel"], 2),
                              f"{m['torch'] / m['kernel']:.2f}x"])
    body = (f"float32, {args.threads} torch threads, hidden {PEER_SPEC.hidden_size}, median of {args.rounds} "
            f"alternating rounds. Load average at the end: {os.getloadavg()[0]:.2f}.\n\n"
            "One `RMSNorm.add_forward` call (residual add + RMSNorm):\n\n"
            + markdown_table(["rows", "torch formula us", "kernel us", "torch / kernel"], call_rows)
            + f"\n\nOne decode step of the benchmark model, in process ({args.steps_per_round} steps per round):\n\n"
            + markdown_table(["batch", "torch formula ms", "kernel ms", "saved ms", "torch / kernel"], step_rows))
    write_result("cpu_norm", "CPU RMSNorm kernel (fused residual add) vs the torch formula", body)


if __name__ == "__main__":
    main()
