"""RL rollouts on the CPU engine: this tree against a base commit, end to end.

bench/peer_rollout.py's first two workloads (a greedy long tail of 96 prompts; GRPO 12 prompts x 8
samples at temperature 1; ``--top-p``: also its GRPO at top_p 0.95; ``--tail``: also two greedy requests
alone, a long tail's last steps), TP1, on an engine of each tree: one process per tree and round, the trees
alternating (base, new, base, new, ...), each starting its own engine per model and dtype, warming it up
and timing the whole rollout. *same sequences*: samples whose tokens are equal between the trees in every
round (a kernel that rounds differently may turn a token; the count says how often it did).

    python bench/rollout_tree_ab.py --base 546c5fa     # writes bench/results/rollout_tree_ab.md
    python bench/rollout_tree_ab.py --base fa1e272 --top-p --result rollout_tree_ab_top_p
    python bench/rollout_tree_ab.py --base ed65a44 --tail --result rollout_tree_ab_skinny
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from pathlib import Path

from common import alternating_rounds, markdown_table, tree_at, write_result

REPO = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent


def measure(shapes: list[str], dtypes: list[str], top_p: bool, tail: bool) -> dict:
    """One round with whichever engine this process imports: {row: [seconds, [a hash per sample]]}."""
    from rollout_ab import ab_cases  # the A/B benches' workloads: each shape's greedy tail and GRPO top_p 1.0
    from peer_rollout import PatRollout, Workload

    out = {}
    for shape in shapes:
        cases = list(ab_cases([shape], top_p, tail))
        for dtype in dtypes:
            pat = PatRollout(cases[0][1], dtype)
            pat.start()
            try:
                for _, _, w in cases:
                    pat.run(Workload("warm-up", w.prompts[:4], [8] * len(w.prompts[:4])))
                    seconds, tokens = pat.run(w)
                    out[f"{shape}|{dtype}|{w.name}|{w.tokens}"] = [
                        seconds, [hashlib.sha1(str(t).encode()).hexdigest()[:12] for t in tokens]]
            finally:
                pat.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--base", help="the commit that is the baseline (required)")
    p.add_argument("--shapes", nargs="+", default=["h768"], help="bench/peer_rollout.py's SHAPES")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--top-p", action="store_true", help="also GRPO at top_p 0.95 (peer_rollout's third workload)")
    p.add_argument("--tail", action="store_true", help="also two greedy requests alone (steps of two rows, then one)")
    p.add_argument("--result", default="rollout_tree_ab", help="the results file's name under bench/results/")
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.measure:
        print(json.dumps(measure(ns.shapes, ns.dtypes, ns.top_p, ns.tail)))
        return
    if ns.base is None:
        p.error("--base is required")
    trees = {"base": tree_at(ns.base, ["pat_engine", "csrc"]), "new": REPO}
    runs = alternating_rounds(__file__, trees, ns.rounds,
                              ["--shapes", *ns.shapes, "--dtypes", *ns.dtypes] + (["--top-p"] if ns.top_p else [])
                              + (["--tail"] if ns.tail else []),
                              env_for=lambda label, tree: {"PYTHONPATH": f"{tree}:{tree / 'csrc'}:{BENCH}"})
    rows = []
    for key in runs["new"][0]:
        shape, dtype, name, tokens = key.split("|")
        base, new = (statistics.median(r[key][0] for r in runs[label]) for label in ("base", "new"))
        samples = list(zip(*(r[key][1] for label in runs for r in runs[label])))
        same = sum(len(set(s)) == 1 for s in samples)
        rows.append([shape, dtype, name, tokens, f"{base:.2f}", f"{new:.2f}", f"{base / new:.2f}x",
                     f"{same}/{len(samples)}"])
    body = (f"Median of {ns.rounds} interleaved rounds (one process per tree and round); seconds from submitting the "
            f"rollout to its last token, every response run to its length (min_new_tokens = max_new_tokens). "
            f"`base`: the engine at commit {ns.base}; `new`: this tree's.\n\n"
            + markdown_table(["model", "dtype", "workload", "tokens", "base s", "new s", "speed-up", "same sequences"],
                             rows))
    write_result(ns.result, "RL rollouts on the CPU engine: this tree against a base commit", body)


if __name__ == "__main__":
    sys.exit(main())
