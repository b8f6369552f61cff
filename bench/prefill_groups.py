"""Prefill of ragged prompts: attention in groups of similar length against one call padded to the longest.

One ``InferExecutor`` per arm (TP1, float32, this process), the same 96 prompts of 16-256 tokens
(bench/peer_rollout.py's mix) prefilled in one step, arms alternating A, B, A, B; the table gives
the median step time and the tokens each arm drew (equal: the grouping changes where attention
pads, not what it computes beyond float32 rounding). Both peer_rollout shapes.

    python bench/prefill_groups.py          # writes bench/results/prefill_groups.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from peer_rollout import SHAPES, model_path  # noqa: E402
from pat_engine.model.arch import load_model_arch  # noqa: E402
from pat_engine.parallel.comm import TPGroup  # noqa: E402
from pat_engine.parallel.layout import Layout  # noqa: E402
from pat_engine.protocol import SeqStep, StepCommand  # noqa: E402
from pat_engine.sampling.spec import SamplingSpec  # noqa: E402
from pat_engine.worker import step_inputs  # noqa: E402
from pat_engine.worker.infer_executor import InferExecutor  # noqa: E402

BLOCK = 16
ARMS = {"grouped (ratio 1.5)": 1.5, "one padded call": float("inf")}


def prefill_seconds(ex: InferExecutor, prompts: list[list[int]], ratio: float, step_id: int) -> tuple[float, list[int]]:
    per_seq = -(-max(map(len, prompts)) // BLOCK)
    seqs = [SeqStep(i, p, 0, block_table=[1 + i * per_seq + j for j in range(-(-len(p) // BLOCK))],
                    sampling=SamplingSpec(1.0, 0, 1.0, i, True)) for i, p in enumerate(prompts)]
    step_inputs._PREFILL_GROUP_RATIO = ratio
    start = time.perf_counter()
    out = ex.execute(StepCommand(step_id, True, seqs))
    seconds = time.perf_counter() - start
    ex.seqs.clear()
    return seconds, out.tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    for shape, spec in SHAPES.items():
        path = model_path(shape)
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(10, spec.vocab_size - 10, (int(torch.randint(16, 257, (), generator=g)),),
                                 generator=g).tolist() for _ in range(args.prompts)]
        ex = InferExecutor(load_model_arch(path), Layout(1, 1), TPGroup(rank=0, size=1, ranks=(0,)), torch.float32,
                           torch.device("cpu"), BLOCK, args.prompts * (256 // BLOCK) + 1)
        ex.load_weights(path)
        prefill_seconds(ex, prompts, 1.5, 0)  # warm-up
        times: dict[str, list[float]] = {}
        tokens: dict[str, list[int]] = {}
        for r in range(args.rounds):
            for name, ratio in ARMS.items():
                s, tokens[name] = prefill_seconds(ex, prompts, ratio, 1 + r)
                times.setdefault(name, []).append(s)
        grouped, single = (statistics.median(times[a]) for a in ARMS)
        real = sum(len(p) ** 2 for p in prompts)
        padded = len(prompts) * max(map(len, prompts)) ** 2
        rows.append([shape, len(prompts), sum(map(len, prompts)), f"{padded / real:.2f}x", f"{single:.3f}",
                     f"{grouped:.3f}", f"{single / grouped:.2f}x", tokens[list(ARMS)[0]] == tokens[list(ARMS)[1]]])
        print(rows[-1], flush=True)
    body = (f"TP1, float32, 2 threads, one prefill step of {args.prompts} prompts of 16-256 tokens; median of "
            f"{args.rounds} rounds, arms alternating. *padding of one call*: query x key area of one call padded "
            "to the longest prompt over the prompts' own (length x length) areas.\n\n"
            + markdown_table(["model", "prompts", "tokens", "padding of one call", "one call s", "grouped s",
                              "speed-up", "same tokens"], rows))
    write_result("prefill_groups", "Ragged prefill: grouped by length vs one padded call", body)


if __name__ == "__main__":
    main()
