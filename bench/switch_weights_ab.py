"""A switch's weights phase: this tree, which writes each new shard into its parameter's own storage, against a
base commit's, which gave each shard fresh memory and freed the old.

Writing in place keeps every parameter at one address across layouts (so decode graphs captured over a
layout can run again when it comes back: docs/switch.md, "The graphs phase") at the price of one more
copy of each new shard (from the shard built beside the old one into the old one's storage). Here, on
bench/switch_overhead.py's model (Llama-shaped, hidden 1024, 8 layers, float32, ~0.5 GB), 4 CPU worker
processes switch idle TP2xDP2 -> TP4xDP1 (a merge: every shard shrinks) and back (a split: every shard
grows) ``--steps`` times each (the first of each discarded); the table gives the median weights phase of
``--rounds`` interleaved rounds, one engine process per tree and round (base, new, base, new, ...), and
whether both trees then generated the same greedy tokens at TP4 and at TP2.

    python bench/switch_weights_ab.py       # writes bench/results/switch_weights_ab.md
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

from common import alternating_rounds, markdown_table, tree_at, tree_comparison_args, tree_medians, write_result

REPO = Path(__file__).resolve().parent.parent
SWITCHES = {"merge TP2xDP2 -> TP4xDP1": 4, "split TP4xDP1 -> TP2xDP2": 2}  # row -> target TP
PROMPTS = [[5, 6, 7], [100, 20, 30, 40], [9, 8]]


def measure(steps: int) -> dict:
    """One round in this process, with whichever ``pat_engine`` its path gives: {row: [seconds, digest]}."""
    from pat_engine import Engine, SamplingParams
    from pat_engine.tiny_model import write_tiny_model
    from switch_overhead import SPEC

    seconds: dict[str, list[float]] = {row: [] for row in SWITCHES}
    tokens = hashlib.sha1()
    with tempfile.TemporaryDirectory() as tmp:
        with Engine(str(write_tiny_model(tmp, SPEC)), tp=2, dp=2, dtype="float32", kv_cache_bytes=256 << 20) as engine:
            for _ in range(steps):
                for row, tp in SWITCHES.items():
                    seconds[row].append(engine.reconfigure(tp=tp).costs["weights_s"])
                    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8), use_tqdm=False)
                    tokens.update(json.dumps([o.token_ids for o in outs]).encode())
    return {row: [statistics.median(v[1:]), tokens.hexdigest()] for row, v in seconds.items()}


def main() -> None:
    ns = tree_comparison_args(__doc__, 5, "switches of each kind per round (the first discarded)", "9919120")
    if ns.measure:
        print(json.dumps(measure(ns.steps)))
        return
    trees = {"base": tree_at(ns.base, ["pat_engine", "csrc"]), "new": REPO}
    runs = alternating_rounds(__file__, trees, ns.rounds, ["--steps", str(ns.steps)])
    rows = []
    for row in SWITCHES:
        base, new, same = tree_medians(runs, row)
        rows.append([row, f"{base:.3f}", f"{new:.3f}", f"{base / new:.2f}x", "yes" if same else "NO"])
    body = (f"4 CPU worker processes, bench/switch_overhead.py's model in float32, idle switches (no request "
            f"running: the weights phase alone moves); median of {ns.rounds} interleaved rounds (one engine "
            f"process per tree and round), each the median of {ns.steps - 1} switches of each kind after a first. "
            f"`base`: commit {ns.base} (fresh memory for every new shard); `new`: this tree (each shard written "
            "into its parameter's storage). `same tokens`: after every switch both trees generated the same "
            "greedy tokens, in every round.\n\n"
            + markdown_table(["switch", "base weights s", "new weights s", "base / new", "same tokens"], rows))
    write_result("switch_weights_ab", "A switch's weights phase: shards written into their own storage vs fresh "
                 "memory", body)


if __name__ == "__main__":
    sys.exit(main())
