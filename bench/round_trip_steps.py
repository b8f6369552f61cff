"""Do TP2 decode steps run slower after a TP2 -> TP1 -> TP2 round trip than in an engine never switched?

    PYTHONPATH=.:bench python bench/round_trip_steps.py [--rounds 6] [--requests 4] [--tokens 48]

Two engines on the controller benchmark's model (bench/cpu_model.py), both at TP2xDP1: one is never
switched ("settled"); the other makes a round trip TP2 -> TP1xDP2 -> TP2 before each of its timed
batches ("round trip"). Each round times the same greedy batch on both, the order rotated round by round
(A, B, B, A, ...) so drifts of this shared host hit both. Reported: each batch's median decode step
(driver side, dispatch to result) and worker forward, and their ratio. The weights and KV keep their
storage across switches (``into_own_storage`` in pat_engine/worker/switch_executor.py); a round trip that left a layout's tensors
slower to read would show here, and the tokens must not change.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import markdown_table, write_result
from cpu_model import DTYPE, WORLD, model_path
from pat_engine import Engine, SamplingParams

SETTLED, TRIP = "settled", "round trip"


def timed_batch(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float, list]:
    """Median decode step and worker forward (seconds) of one greedy batch, and its tokens."""
    with engine.record_steps() as log:
        outs = engine.generate(prompts, params, use_tqdm=False)
    decode = [r for r in log if not r.is_prefill and r.tp == WORLD]
    assert decode, "no TP2 decode steps were recorded"
    return (statistics.median(r.seconds for r in decode), statistics.median(r.forward_seconds for r in decode),
            [o.token_ids for o in outs])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--prompt", type=int, default=64)
    args = p.parse_args()
    prompts = [[(17 * i + 31 * j) % 1900 + 16 for j in range(args.prompt)] for i in range(args.requests)]
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    kwargs = dict(tp=WORLD, dp=1, dtype=DTYPE, kv_cache_bytes=1 << 30)
    step: dict[str, list[float]] = {SETTLED: [], TRIP: []}
    forward: dict[str, list[float]] = {SETTLED: [], TRIP: []}
    trips: list[float] = []
    load_before = os.getloadavg()
    with Engine(model_path(), **kwargs) as settled, Engine(model_path(), **kwargs) as tripped:
        tokens = timed_batch(settled, prompts, params)[2]  # a warm-up of each, not timed
        assert timed_batch(tripped, prompts, params)[2] == tokens
        for r in range(args.rounds):
            order = [SETTLED, TRIP] if r % 2 == 0 else [TRIP, SETTLED]
            for label in order:
                engine = settled if label == SETTLED else tripped
                if label == TRIP:
                    t = time.perf_counter()
                    engine.reconfigure(1)
                    engine.reconfigure(WORLD)
                    trips.append(time.perf_counter() - t)
                s, f, toks = timed_batch(engine, prompts, params)
                assert toks == tokens, f"{label}, round {r + 1}: tokens changed"
                step[label].append(s)
                forward[label].append(f)
    load_after = os.getloadavg()
    rows = []
    for label in (SETTLED, TRIP):
        rows.append([label, " / ".join(f"{x * 1e3:.1f}" for x in step[label]),
                     f"{statistics.median(step[label]) * 1e3:.1f}", f"{statistics.median(forward[label]) * 1e3:.1f}"])
    pair = [t / s for t, s in zip(step[TRIP], step[SETTLED])]
    pair_fwd = [t / s for t, s in zip(forward[TRIP], forward[SETTLED])]
    body = (f"Model bench/cpu_model.py ({DTYPE}), two engines at TP{WORLD}xDP1; {args.requests} greedy requests of "
            f"{args.prompt} prompt tokens, {args.tokens} new tokens each (ignore_eos); {args.rounds} rounds, order "
            f"rotated. The round-trip engine switched TP{WORLD} -> TP1xDP{WORLD} -> TP{WORLD} before each batch "
            f"(median {statistics.median(trips):.2f} s a round trip).\n"
            f"Load average before/after: {load_before[0]:.2f}/{load_after[0]:.2f} (2 cores, shared machine).\n\n"
            + markdown_table(["engine", "median decode step, ms (each round)", "median of rounds, ms",
                              "median worker forward, ms"], rows)
            + f"\n\nRound trip / settled, per round: step {' / '.join(f'{x:.3f}' for x in pair)} "
              f"(median **{statistics.median(pair):.3f}**); forward {' / '.join(f'{x:.3f}' for x in pair_fwd)} "
              f"(median **{statistics.median(pair_fwd):.3f}**).\n\nTokens identical in every batch: **True** (asserted after each "
              f"batch: the run stops otherwise)\n")
    write_result("round_trip_steps", "TP2 decode steps after a round trip against an engine never switched", body)


if __name__ == "__main__":
    main()
