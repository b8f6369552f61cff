"""The sampling part of an RL decode step: the new sampler against the one it replaced, and against greedy.

At batch ``--batch`` and two vocabularies (16,384 and Qwen's 151,936), float32 logits, every row
asking for its log-prob (as RL rollouts do), the time of ``sample_batch`` for:

- greedy (argmax + log-prob),
- temperature 1 with no filter, with top_p 0.95, with top_k 50, with min_p 0.05,

on LM-like (Zipf-shaped) logits and on flat ones (the worst case for top_p),

for the current sampler (``new``: inverse CDF in token-id order, C++ kernel) and for the sampler of
commit ``--old`` (float64 softmax, full sort, cumulative sum), loaded from git. Runs alternate
(old, new, old, new, ...) on this noisy shared host; the table gives the median of ``--rounds``.
The LM head's GEMM at hidden 768 is timed beside them, as the scale of a decode step's own work.

    python bench/sampler_step.py            # writes bench/results/sampler_step.md
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import markdown_table, write_result
from pat_engine.sampling import sampler as new_sampler

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


def load_old(commit: str):
    """The sampler module as it was at ``commit``, with the processors module of that commit
    (temporary files, imported under their own names)."""
    folder = Path(tempfile.mkdtemp())

    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO, check=True, capture_output=True,
                              text=True).stdout

    (folder / "old_processors.py").write_text(show("pat_engine/sampling/processors.py"))
    (folder / "old_sampler.py").write_text(show("pat_engine/sampling/sampler.py").replace(
        "from pat_engine.sampling.processors import", "from old_processors import"))
    sys.path.insert(0, str(folder))
    return importlib.import_module("old_sampler")


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per round (the best counts)")
    p.add_argument("--old", default="2187ceb", help="the commit whose sampler is the baseline")
    ns = p.parse_args()
    old = load_old(ns.old)
    g = torch.Generator().manual_seed(0)
    rows = []
    for vocab, shape in [(v, sh) for v in VOCABS for sh in SHAPES]:
        logits = make_logits(shape, ns.batch, vocab, g)
        hidden = torch.randn(ns.batch, HIDDEN, generator=g)
        head = torch.randn(vocab, HIDDEN, generator=g) / HIDDEN**0.5
        gemm = statistics.median(seconds(lambda: hidden @ head.T, ns.repeats) for _ in range(ns.rounds))
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(ns.rounds):
            for name, case in CASES.items():
                for label, module in (("old", old), ("new", new_sampler)):
                    b = batch_for(module, case, ns.batch, vocab)
                    times.setdefault((name, label), []).append(seconds(lambda: module.sample_batch(logits, b),
                                                                       ns.repeats))
        greedy_new = statistics.median(times[("greedy", "new")])
        for name in CASES:
            o, n = statistics.median(times[(name, "old")]), statistics.median(times[(name, "new")])
            rows.append([vocab, shape, name, f"{o * 1e3:.1f}", f"{n * 1e3:.1f}", f"{o / n:.2f}x",
                         f"{(n - greedy_new) * 1e3:+.1f}", f"{gemm * 1e3:.1f}"])
    body = (f"Batch {ns.batch}, float32 logits, every row asking for its log-prob; median of {ns.rounds} "
            f"interleaved rounds, each the best of {ns.repeats} calls. `old`: the sampler at commit {ns.old}; "
            "`new`: this tree's. `new - greedy`: what sampling adds to a greedy step's sampling. "
            f"`LM head`: the (batch x {HIDDEN}) @ ({HIDDEN} x vocab) GEMM, the scale of a step's own work.\n\n"
            + markdown_table(["vocab", "logits", "case", "old ms", "new ms", "speed-up", "new - greedy ms", "LM head ms"],
                             rows))
    write_result("sampler_step", "Sampling an RL decode step: inverse CDF in id order vs sort", body)


if __name__ == "__main__":
    sys.exit(main())
