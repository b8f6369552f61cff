"""A sampled decode step's draw with its uniforms hashed on the host (numpy) vs on the device (torch ops).

Every sampled row draws with one uniform number, ``uniform_for(seed, position)`` (sampling/seeds.py). The
base commit hashed the batch's seeds and positions with about two dozen int64 torch ops inside the step
(on a GPU, two dozen tiny kernels per step); this tree hashes them with numpy while it builds the step's
``SamplingBatch`` and sends one float64 vector (and the rows' float32 inverse temperatures, computed on
the device before too). Timed here: what a worker does for one step's sampled rows,
``SamplingBatch.build`` + ``sample_on_device`` + the read back, at temperature 1 with log-probs (RL
rollouts), batch 1 to 256, on a 512-token vocabulary (the hash's share is largest) and on Qwen's 151,936
(Zipf-shaped logits). One process per tree and round, alternating (base, new, ...); both trees use this
checkout's C++ kernels (csrc/ is unchanged between them); the draws of both trees are compared.

    python bench/sampling_uniforms.py            # writes bench/results/sampling_uniforms.md
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
VOCABS = (512, 151936)


def measure(steps: int) -> dict:
    """One round in this process, with whichever ``pat_engine`` its path gives: {row: [seconds, digest]}."""
    from pat_engine.sampling.sampler import SamplingBatch, sample_on_device
    from pat_engine.sampling.spec import SamplingSpec

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    out = {}
    for vocab in VOCABS:
        for batch in BATCHES:
            ranks = torch.stack([torch.randperm(vocab, generator=g) for _ in range(batch)]).float() + 1
            logits = -1.5 * torch.log(ranks) + 0.5 * torch.randn(batch, vocab, generator=g)
            specs = [SamplingSpec(1.0, -1, 1.0, seed=1000 + i, logprobs=True) for i in range(batch)]
            times, digest = [], hashlib.sha1()
            for k in range(steps):
                t = time.perf_counter()
                drawn = sample_on_device(logits, SamplingBatch.build(specs, [200 + k] * batch, vocab=vocab)).to_host()
                times.append(time.perf_counter() - t)
                digest.update(json.dumps([drawn.tokens, drawn.logprobs]).encode())
            out[f"{vocab}|{batch}"] = [statistics.median(times), digest.hexdigest()]
    return out


def main() -> int:
    ns = tree_comparison_args(__doc__, 100, "steps per row and round (the median counts)", "4896095")
    if ns.measure:
        print(json.dumps(measure(ns.steps)))
        return 0
    trees = {"base": tree_at(ns.base, ["pat_engine"]), "new": REPO}
    bench = Path(__file__).resolve().parent

    def env_for(label: str, tree: Path) -> dict[str, str]:
        return {"PYTHONPATH": f"{tree}:{REPO / 'csrc'}:{bench}"}

    runs = alternating_rounds(__file__, trees, ns.rounds, ["--steps", str(ns.steps)], env_for)
    rows = []
    for key in runs["new"][0]:
        vocab, batch = key.split("|")
        base, new, same = tree_medians(runs, key)
        rows.append([vocab, batch, f"{base * 1e6:.0f}", f"{new * 1e6:.0f}", f"{base / new:.2f}x",
                     "yes" if same else "NO"])
    body = (f"CPU, one torch thread; median of {ns.rounds} interleaved rounds (one process per tree and round), "
            f"each the median of {ns.steps} steps. `base`: commit {ns.base} (uniforms hashed by torch ops in "
            "the draw); `new`: this tree (hashed by numpy in `SamplingBatch.build`). `same draws`: every round of "
            "both trees drew the same tokens and log-probs.\n\n"
            + markdown_table(["vocab", "batch", "base us", "new us", "speed-up", "same draws"], rows))
    write_result("sampling_uniforms", "A sampled step's draw: uniforms hashed on the host vs by device ops", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
