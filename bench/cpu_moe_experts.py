"""Decode steps of a Qwen3-MoE model on the CPU: the experts kernel (each core whole experts) against the experts
run one after another through torch (``PAT_CPU_MOE=torch``).

bench/peer_rollout.py's ``moe`` shape (hidden 768, 6 layers, 32 experts of 512, 4 a token; vocab 16,384), one
worker in this process (the real driver over an in-process executor, as the fast tests run it), fast numerics.
At each batch size the decode step time is taken as (time of 4 + 40 steps - time of 4 steps) / 40 after the
same prefill, with ``PAT_CPU_MOE`` flipped between runs, interleaved (kernel, torch, kernel, ...); the h768
dense model (the same attention and vocabulary, a dense MLP as wide as four experts) beside it. Steps at
batch 8 and more touch most experts: their weights (4.7 MB each in float32) stream from memory. The engine
takes the kernel where some expert has two rows or more (at batch 1 each of the 4 experts has one row, and
torch runs the step either way).

    python bench/cpu_moe_experts.py            # writes bench/results/cpu_moe_experts.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent / "tests")]
from common import markdown_table, write_result  # noqa: E402
from local_workers import local_driver  # noqa: E402
from pat_kernels import cpu_moe  # noqa: E402
from peer_rollout import SHAPES, describe, model_path  # noqa: E402

from pat_engine import SamplingParams  # noqa: E402

SHORT, LONG = 4, 44


def step_ms(driver, batch: int, seed: int) -> float:
    """Milliseconds a decode step of ``batch`` sequences takes (prompts of 16 tokens; the prefill cancels out)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, 16000, (16,), generator=g).tolist() for _ in range(batch)]

    def run(steps: int) -> float:
        t = time.perf_counter()
        driver.generate(prompts, [SamplingParams(max_new_tokens=steps, ignore_eos=True)] * batch)
        return time.perf_counter() - t

    short, long = run(SHORT), run(LONG)
    return (long - short) / (LONG - SHORT) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 96])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    rows = []
    for dtype in args.dtypes:
        moe = local_driver(model_path("moe"), kv_blocks=2048, block_size=16, dtype=dtype)
        dense = local_driver(model_path("h768"), kv_blocks=2048, block_size=16, dtype=dtype)
        step_ms(moe, 2, 0), step_ms(dense, 2, 0)  # warm-up: packs, the kernel library
        for batch in args.batches:
            times: dict[str, list[float]] = {"kernel": [], "torch": [], "dense": []}
            for r in range(args.rounds):
                for name in ("kernel", "torch"):
                    os.environ[cpu_moe.ENV_SWITCH] = name
                    times[name].append(step_ms(moe, batch, r))
                times["dense"].append(step_ms(dense, batch, r))
            os.environ.pop(cpu_moe.ENV_SWITCH, None)
            kernel, plain, dense_ms = (statistics.median(times[k]) for k in ("kernel", "torch", "dense"))
            rows.append([dtype, batch, f"{kernel:.2f}", f"{plain:.2f}", f"{plain / kernel:.2f}x", f"{dense_ms:.2f}"])
            print(rows[-1], flush=True)
    body = (f"Median of {args.rounds} interleaved rounds; milliseconds per decode step of one worker using "
            f"{torch.get_num_threads()} threads, fast numerics.\n\n"
            + markdown_table(["dtype", "batch", "MoE, default ms", "MoE, PAT_CPU_MOE=torch ms", "speed-up",
                              "dense h768 ms"], rows)
            + f"\n\nModels: `moe`: {describe(SHAPES['moe'])}; `h768`: {describe(SHAPES['h768'])}.")
    write_result("cpu_moe_experts", "MoE decode steps on the CPU: the experts kernel vs the experts in turn", body)


if __name__ == "__main__":
    main()
