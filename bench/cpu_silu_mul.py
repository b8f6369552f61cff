"""The CPU SiLU-and-mul kernel against torch's formula it replaces, in whole prefills and decode steps.

    PYTHONPATH=.:profiler:integrations:csrc:bench python bench/cpu_silu_mul.py [--rounds 7]

For each model shape (bench/peer_rollout.py's ``h768`` and ``moe``) and dtype, one worker's executor runs in
process (2 threads, fast numerics): a prefill of 16 prompts of 128 tokens (one 2048-token step) and decode
steps at batch 1, 16 and 64, each with the kernel (the default) and with ``PAT_CPU_ACTIVATION=torch``. The
two settings take turns, the order reversed every round, so the shared host's load hits them alike;
medians. The kernel's output has the formula's bits (tests/test_cpu_activation.py), so only time differs.
In ``moe`` every layer's experts run in the MoE kernel, which applies SiLU-mul itself whatever the switch, as
soon as an expert has two rows: its prefill and larger decode rows change nothing and show the host's noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_breakdown  # noqa: E402
from common import markdown_table, write_result  # noqa: E402
from peer_rollout import SHAPES, describe, model_path  # noqa: E402
from pat_kernels import cpu_activation, cpu_extension  # noqa: E402

SETTINGS = ("kernel", "torch")


def alternate(run_once, rounds: int, repeats: int) -> dict[str, float]:
    """Median ms of ``run_once()`` under each setting, turns alternating, the order reversed every round."""
    times: dict[str, list[float]] = {s: [] for s in SETTINGS}
    for r in range(rounds):
        for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
            os.environ[cpu_activation.ENV_SWITCH] = setting
            start = time.perf_counter()
            for _ in range(repeats):
                run_once()
            times[setting].append((time.perf_counter() - start) / repeats * 1e3)
    os.environ.pop(cpu_activation.ENV_SWITCH, None)
    return {s: statistics.median(v) for s, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=["h768", "moe"], choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--decode-steps", type=int, default=4, help="steps per turn")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_extension.load():
        sys.exit(f"the CPU extension cannot be built: {cpu_extension._failed}")

    rows = []
    for shape in args.shapes:
        step_breakdown.SPEC = SHAPES[shape]  # the prompts' vocabulary
        path = model_path(shape)
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            prefill = step_breakdown.Rollout(path, 16, 128, 4, False, dtype=dtype)
            for _ in range(2):  # first touches and oneDNN's kernels for the shapes, outside the timing
                prefill.prefill()
            cases = [("prefill 16 x 128", alternate(prefill.prefill, args.rounds, 1))]
            del prefill
            for batch in args.decode_batches:
                steps = 2 * args.rounds * args.decode_steps + 8
                run = step_breakdown.Rollout(path, batch, 32, steps, False, dtype=dtype)
                run.prefill()
                for _ in range(4):
                    run.decode()
                cases.append((f"decode step, batch {batch}", alternate(run.decode, args.rounds, args.decode_steps)))
            for case, m in cases:
                rows.append([shape, dtype_name, case, round(m["kernel"], 2), round(m["torch"], 2),
                             f"{m['torch'] / m['kernel']:.3f}x"])
            print(rows[-len(cases):], flush=True)
    body = (f"{args.threads} torch threads, one worker's executor in process, fast numerics; median ms over "
            f"{args.rounds} alternating rounds (a prefill once a turn, decode steps {args.decode_steps} a turn). "
            f"Load average at the end: {os.getloadavg()[0]:.2f}.\n\n"
            + markdown_table(["model", "dtype", "step", "kernel ms", "PAT_CPU_ACTIVATION=torch ms",
                              "speed-up"], rows)
            + "\n\n`moe`'s experts take SiLU-mul inside the MoE kernel whatever the switch once an expert has two "
              "rows (its prefill, most of its decode steps at batch 16 and 64): those rows measure the host's noise."
            + "\n\nModels: " + "; ".join(f"`{s}`: {describe(SHAPES[s])}" for s in args.shapes))
    write_result("cpu_silu_mul", "The CPU SiLU-and-mul kernel vs torch's formula, per prefill and decode step", body)


if __name__ == "__main__":
    main()
