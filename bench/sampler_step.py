"""The sampling part of an RL decode step: this tree's sampler against a base commit's, and against greedy.

At batch ``--batch`` and two vocabularies (16,384 and Qwen's 151,936), float32 logits, every row
asking for its log-prob (as RL rollouts do), the time of ``sample_batch`` for:

- greedy (argmax + log-prob),
- temperature 1 with no filter, with top_p 0.95, with top_k 50, with min_p 0.05,

on LM-like (Zipf-shaped) logits and on flat ones (the worst case for top_p).

``base`` is the sampler of commit ``--base``, its Python and its C++ kernel (the tree is taken with
``git archive`` and the kernel built into its own extensions folder); ``new`` is this tree's. Each
round runs one process per tree, alternating (base, new, base, new, ...) on this noisy shared host;
the table gives the median of ``--rounds`` and whether both trees drew the same tokens and log-probs. The LM head's GEMM at hidden 768 is timed beside them, as the scale of a step's own work.

    python bench/sampler_step.py            # writes bench/results/sampler_step.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import alternating_rounds, markdown_table, tree_at, write_result

REPO = Path(__file__).resolve().parent.parent
VOCABS = (16384, 151936)
HIDDEN = 768
CASES = {
    "greedy": dict(temperature=0.0, top_k=-1, top_p=1.0),
    "t=1": dict(temperature=1.0, top_k=-1, top_p=1.0),
    "t=1 top_p 0.95": dict(temperature=1.0, top_k=-1, top_p=0.95),
    "t=1 top_k 50": dict(temperature=1.0, top_k=50, top_p=1.0),
    "t=1 min_p 0.05": dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.05),
}


SHAPES = ("zipf", "flat")


def make_logits(shape: str, rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """``zipf``: an LM-like row (probability falling as rank**-1.5, with noise: top_p 0.95 keeps a few
    hundred to a few thousand tokens); ``flat``: N(0, 3) logits, the worst case for top_p (its
    nucleus spans tens of thousands of tokens)."""
    if shape == "flat":
        return torch.randn(rows, vocab, generator=g) * 3
    ranks = torch.stack([torch.randperm(vocab, generator=g) for _ in range(rows)]).float() + 1
    return -1.5 * torch.log(ranks) + 0.5 * torch.randn(rows, vocab, generator=g)


def batch_for(module, case: dict, rows: int, vocab: int):
    specs = [module.SamplingSpec(case["temperature"], case["top_k"], case["top_p"], seed=1000 + i, logprobs=True,
                                 min_p=case.get("min_p", 0.0)) for i in range(rows)]
    return module.SamplingBatch.build(specs, [200 + i for i in range(rows)], vocab=vocab)


def seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(batch: int, repeats: int) -> dict:
    """One round in this process, with whichever ``pat_engine`` its path gives: every case's best time
    and a digest of its draws, and the LM head GEMM's time."""
    from pat_engine.sampling import sampler

    g = torch.Generator().manual_seed(0)
    out = {}
    for vocab, shape in [(v, sh) for v in VOCABS for sh in SHAPES]:
        logits = make_logits(shape, batch, vocab, g)
        hidden = torch.randn(batch, HIDDEN, generator=g)
        head = torch.randn(vocab, HIDDEN, generator=g) / HIDDEN**0.5
        out[f"{vocab}|{shape}|LM head"] = [seconds(lambda: hidden @ head.T, repeats), "", ""]
        for name, case in CASES.items():
            b = batch_for(sampler, case, batch, vocab)
            drawn = sampler.sample_batch(logits, b)
            digests = [hashlib.sha1(json.dumps(v).encode()).hexdigest() for v in (drawn.tokens, drawn.logprobs)]
            out[f"{vocab}|{shape}|{name}"] = [seconds(lambda: sampler.sample_batch(logits, b), repeats), *digests]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per round (the best counts)")
    p.add_argument("--base", default="e6d86e4", help="the commit whose sampler is the baseline")
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one round, JSON on stdout
    ns = p.parse_args()
    if ns.measure:
        print(json.dumps(measure(ns.batch, ns.repeats)))
        return
    trees = {"base": tree_at(ns.base, ["pat_engine", "csrc"]), "new": REPO}
    scratch = Path(tempfile.mkdtemp(prefix="sampler-ext-"))

    def env_for(label: str, tree: Path) -> dict[str, str]:  # each tree's C++ kernel, built into its own folder
        return {"PYTHONPATH": os.pathsep.join([str(tree), str(tree / "csrc"), str(Path(__file__).parent)]),
                "TORCH_EXTENSIONS_DIR": str(scratch / label)}

    runs = alternating_rounds(__file__, trees, ns.rounds, ["--batch", str(ns.batch), "--repeats", str(ns.repeats)],
                              env_for)

    def ms(label: str, key: str) -> float:
        return statistics.median(r[key][0] for r in runs[label]) * 1e3

    rows = []
    for vocab, shape in [(v, sh) for v in VOCABS for sh in SHAPES]:
        gemm = ms("new", f"{vocab}|{shape}|LM head")
        greedy = ms("new", f"{vocab}|{shape}|greedy")
        for name in CASES:
            key = f"{vocab}|{shape}|{name}"
            b, n = ms("base", key), ms("new", key)
            same = ["yes" if len({r[key][i] for label in runs for r in runs[label]}) == 1 else "NO" for i in (1, 2)]
            rows.append([vocab, shape, name, f"{b:.1f}", f"{n:.1f}", f"{b / n:.2f}x", f"{n - greedy:+.1f}",
                         f"{gemm:.1f}", *same])
    body = (f"Batch {ns.batch}, float32 logits, every row asking for its log-prob; median of {ns.rounds} "
            f"interleaved rounds (one process per tree and round), each the best of {ns.repeats} calls. `base`: "
            f"the sampler (Python and C++ kernel) at commit {ns.base}; `new`: this tree's. `new - greedy`: what "
            "sampling adds to a greedy step's sampling. `LM head`: the (batch x "
            f"{HIDDEN}) @ ({HIDDEN} x vocab) GEMM, the scale of a step's own work. `same tokens`, `same log-probs`: "
            "every round of both trees gave the same (a change of the rule between the trees shows here).\n\n"
            + markdown_table(["vocab", "logits", "case", "base ms", "new ms", "speed-up", "new - greedy ms",
                              "LM head ms", "same tokens", "same log-probs"], rows))
    write_result("sampler_step", "Sampling an RL decode step: this tree's sampler against a base commit's", body)


if __name__ == "__main__":
    sys.exit(main())
