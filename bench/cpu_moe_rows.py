"""MoE prefills on the CPU with new prompts every step: each expert's GEMM rows rounded (``cpu_gemm.expert_rows``)
against run as given.

    PYTHONPATH=.:profiler:integrations:csrc:bench python bench/cpu_moe_rows.py [--rounds 3] [--steps 10]

oneDNN builds a kernel for every new row count of a packed GEMM (a fraction of a millisecond each) and keeps it.
A prefill's experts each get a row count that moves with the routing, so with new prompts each step a fresh
process meets new counts for many steps. Each run is a fresh process (one worker's executor in process, 2
threads, the environment an engine gives a CPU worker) that prefills ``--steps`` batches of 16 new prompts of
128 tokens (bench/peer_rollout.py's ``moe`` shape; the same prompts in both settings), timing each step;
settings alternate process by process (rounded, exact, exact, rounded, ...). Reported per setting: the first
step, the median of steps 2-4 (the warm-up), the median of the last half, medians over rounds. The rounding
adds at most 1/16 of an expert's rows and, on this host, changes no bit (tests/test_moe.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ("rounded", "exact")


def measure(setting: str, dtype_name: str, steps: int) -> list[float]:
    """Milliseconds of each of ``steps`` prefills with new prompts (run inside the child process)."""
    import torch

    import step_breakdown
    from pat_engine.model import cpu_gemm
    from peer_rollout import SHAPES, model_path

    torch.set_num_threads(2)
    if setting == "exact":
        cpu_gemm.expert_rows = lambda rows: rows
    step_breakdown.SPEC = SHAPES["moe"]
    run = step_breakdown.Rollout(model_path("moe"), 16, 128, 4, False, dtype=getattr(torch, dtype_name))
    g = torch.Generator().manual_seed(7)
    times = []
    for _ in range(steps):
        run.prompts = torch.randint(10, SHAPES["moe"].vocab_size - 10, (16, 128), generator=g).tolist()
        start = time.perf_counter()
        run.prefill()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def child(setting: str, dtype_name: str, steps: int) -> list[float]:
    from common import json_from_worker_process

    code = f"import json, cpu_moe_rows; print(json.dumps(cpu_moe_rows.measure({setting!r}, {dtype_name!r}, {steps})))"
    return json_from_worker_process(code, ROOT, f"the {setting} run")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from common import markdown_table, write_result

    rows = []
    for dtype_name in args.dtypes:
        runs: dict[str, list[list[float]]] = {s: [] for s in SETTINGS}
        for r in range(args.rounds):
            for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
                runs[setting].append(child(setting, dtype_name, args.steps))
                print(setting, dtype_name, [round(t) for t in runs[setting][-1]], flush=True)
        summary = {}
        for setting, times in runs.items():
            summary[setting] = [statistics.median(t[0] for t in times),
                                statistics.median(statistics.median(t[1:4]) for t in times),
                                statistics.median(statistics.median(t[args.steps // 2:]) for t in times)]
        for setting in SETTINGS:
            rows.append([dtype_name, setting] + [f"{v:.0f}" for v in summary[setting]])
        rows.append([dtype_name, "exact / rounded"]
                    + [f"{e / r:.2f}x" for e, r in zip(summary["exact"], summary["rounded"])])
    body = (f"{args.rounds} rounds of a fresh process per setting, {args.steps} prefills each (16 new prompts of 128 "
            "tokens, one 2048-token step), ms; medians over rounds.\n\n"
            + markdown_table(["dtype", "expert GEMM rows", "first step", "steps 2-4 (median)",
                              f"steps {args.steps // 2 + 1}-{args.steps} (median)"], rows))
    write_result("cpu_moe_rows", "MoE prefills with new prompts: experts' GEMM rows rounded vs as given", body)


if __name__ == "__main__":
    main()
