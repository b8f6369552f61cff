"""A decode step's input preparation on the host: this tree's ``StepInputBuilder.build`` against a base commit's.

The worker turns each ``StepCommand`` into tensors (token ids, positions, the block table, KV slots,
context lengths) and the sampling batch before the forward starts; on a GPU that host work runs while
the device waits (the third H100 run: a batch-1 step 7.04 ms in process, its decode graph alone 5.96).
Here the builder runs on the CPU at batch 1, 16, 64 and 256 with a 512-token context (a 33-block
table per row), greedy and temperature 1 with log-probs, and once for prefills of 64 x 512 and 8 x 4096. Each round
runs one process per tree, alternating (base, new, base, new, ...); the table gives the median of
``--rounds``, each the median of ``--steps`` builds, and checks that both trees built the same tensors.

    python bench/step_prepare.py            # writes bench/results/step_prepare.md
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from common import alternating_rounds, markdown_table, tree_at, tree_comparison_args, tree_medians, write_result

REPO = Path(__file__).resolve().parent.parent
BATCHES = (1, 16, 64, 256)
PREFILLS = ((64, 512), (8, 4096))  # issue 30's prefill shapes (one build each)
CONTEXT, BLOCK, VOCAB = 512, 16, 128256
CASES = {"greedy": dict(temperature=0.0, logprobs=False), "t=1 logprobs": dict(temperature=1.0, logprobs=True)}


def _digest(step) -> str:
    """What the step's tensors hold (inputs, attention metadata, sampling batch), as one hash."""
    h = hashlib.sha1()
    for t in (step.input_ids, step.positions, step.attn.slot_mapping, step.attn.block_tables, step.attn.context_lens):
        h.update(t.cpu().numpy().tobytes())
    if step.sampling is not None:
        for t in vars(step.sampling).values():
            if isinstance(t, torch.Tensor):
                h.update(t.cpu().numpy().tobytes())
    return h.hexdigest()


def measure(steps: int) -> dict:
    """One round in this process, with whichever ``pat_engine`` its path gives: {row: [seconds, digest]}."""
    from pat_engine.protocol import SeqStep, StepCommand
    from pat_engine.sampling.spec import SamplingSpec
    from pat_engine.worker.step_inputs import StepInputBuilder

    torch.set_num_threads(1)
    width = -(-(CONTEXT + steps + 1) // BLOCK)
    out = {}
    for case, kw in CASES.items():
        spec = SamplingSpec(kw["temperature"], -1, 1.0, 7, kw["logprobs"])
        for batch, length in PREFILLS:
            builder = StepInputBuilder(BLOCK, torch.device("cpu"), VOCAB)
            blocks = -(-length // BLOCK)
            cmd = StepCommand(0, True, [SeqStep(i, [5] * length, 0, block_table=list(range(i * blocks, (i + 1) * blocks)),
                                                sampling=spec) for i in range(batch)])
            t = time.perf_counter()
            step = builder.build(cmd, True)
            out[f"{case}|prefill {batch} x {length}"] = [time.perf_counter() - t, _digest(step)]
        for batch in BATCHES:
            builder = StepInputBuilder(BLOCK, torch.device("cpu"), VOCAB)
            prefill = StepCommand(0, True, [SeqStep(i, [5] * CONTEXT, 0, block_table=list(range(i * width, (i + 1) * width)),
                                                    sampling=spec) for i in range(batch)])
            builder.build(prefill, True)
            times, digest = [], hashlib.sha1()
            for k in range(steps):
                cmd = StepCommand(k + 1, False, [SeqStep(i, [(i + k) % 1000], CONTEXT + k) for i in range(batch)])
                t = time.perf_counter()
                step = builder.build(cmd, True)
                times.append(time.perf_counter() - t)
                digest.update(_digest(step).encode())
            out[f"{case}|decode batch {batch}"] = [statistics.median(times), digest.hexdigest()]
    return out


def main() -> None:
    ns = tree_comparison_args(__doc__, 200, "decode builds per row and round (the median counts)", "e347249")
    if ns.measure:
        print(json.dumps(measure(ns.steps)))
        return
    trees = {"base": tree_at(ns.base, ["pat_engine"]), "new": REPO}
    runs = alternating_rounds(__file__, trees, ns.rounds, ["--steps", str(ns.steps)])
    rows = []
    for key in runs["new"][0]:
        case, row = key.split("|")
        base, new, same = tree_medians(runs, key)
        rows.append([row, case, f"{base * 1e6:.0f}", f"{new * 1e6:.0f}", f"{base / new:.2f}x", "yes" if same else "NO"])
    body = (f"CPU builds (one torch thread), block {BLOCK}, {CONTEXT}-token contexts; median of {ns.rounds} "
            f"interleaved rounds (one process per tree and round), each the median of {ns.steps} decode builds "
            f"(a prefill: one build). `base`: the builder and sampling batch at commit {ns.base}; `new`: this "
            "tree's. `same tensors`: every round of both trees built the same values.\n\n"
            + markdown_table(["step", "sampling", "base us", "new us", "speed-up", "same tensors"], rows))
    write_result("step_prepare", "A step's input preparation: this tree's builder against a base commit's", body)


if __name__ == "__main__":
    sys.exit(main())
