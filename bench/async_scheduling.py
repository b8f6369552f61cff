"""Async scheduling on and off, side by side in one engine (CPU, TP1, one worker process).

With ``async_scheduling`` the driver sends each decode step before the one in flight is answered
(docs/async_scheduling.md): the worker runs the next step while the driver handles the last one's
tokens. One engine per model shape runs each workload with the switch off, then on, then off...
(``--rounds`` pairs, interleaved on this noisy host); the table gives each mode's median seconds,
their ratio and whether both modes returned the same tokens and log-probs in every round.

Workloads: the tail alone (one request, greedy, ``--tail-tokens`` new tokens: the batch-1 decode
issue 30 is about), and bench/peer_rollout.py's GRPO rollout (12 prompts x 8 samples, temperature 1,
ragged prompts of 16-256 tokens, long-tailed response lengths) on its two model shapes.

    PYTHONPATH=.:profiler:integrations:csrc python bench/async_scheduling.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from peer_rollout import MAX_LEN, SHAPES, Workload, model_path, workloads  # noqa: E402
from pat_engine import Engine, SamplingParams  # noqa: E402


def _params(w: Workload) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=m, min_new_tokens=m, n=w.n, temperature=w.temperature, top_p=w.top_p,
                           seed=1000 + i, logprobs=True) for i, m in enumerate(w.max_tokens)]


def _run(engine: Engine, w: Workload, on: bool) -> tuple[float, list]:
    engine.coordinator.stepping.set_async_scheduling(on)
    t = time.perf_counter()
    outs = engine.generate(w.prompts, _params(w), use_tqdm=False)
    seconds = time.perf_counter() - t
    return seconds, [(s.token_ids, s.logprobs) for o in outs for s in (o.samples or [o])]


def _same_samples(a: list, b: list) -> int:
    """Samples whose tokens and log-probs are equal, bit for bit, between two runs."""
    return sum(x == y for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=3, help="off/on pairs per workload")
    ap.add_argument("--tail-tokens", type=int, default=384)
    args = ap.parse_args()

    rows = []
    for shape in args.shapes:
        spec = SHAPES[shape]
        grpo = workloads(spec.vocab_size, seed=7)[1]
        tail = Workload(f"tail alone: 1 request, greedy, {args.tail_tokens} tokens", [grpo.prompts[0]],
                        [args.tail_tokens])
        with Engine(model_path(shape), tp=1, dtype="float32", max_model_len=MAX_LEN) as engine:
            _run(engine, tail, True)  # warm-up: kernels built, pools touched
            for w in (tail, grpo):
                times: dict[bool, list[float]] = {False: [], True: []}
                outs: dict[bool, list] = {False: [], True: []}
                for _ in range(args.rounds):
                    for on in (False, True):
                        seconds, out = _run(engine, w, on)
                        times[on].append(seconds)
                        outs[on].append(out)
                off, on = statistics.median(times[False]), statistics.median(times[True])
                ratios = [a / b for a, b in zip(times[False], times[True])]
                samples = len(outs[False][0])
                modes = min(_same_samples(a, b) for a, b in zip(outs[False], outs[True]))
                control = min((_same_samples(outs[False][0], b) for b in outs[False][1:]), default=None)
                rows.append([shape, w.name, w.tokens, round(off, 3), round(on, 3), f"{off / on:.3f}x",
                             f"{min(ratios):.3f}-{max(ratios):.3f}x", f"{modes}/{samples}",
                             "-" if control is None else f"{control}/{samples}"])
                print(rows[-1], flush=True)

    body = (f"One engine per shape (TP1, one worker process, float32, max model length {MAX_LEN}); each workload "
            f"run {args.rounds} times with async scheduling off and on, alternating (off, on, off, on, ...). "
            f"Seconds from submitting the workload to its last token, median over the rounds; *speed-up*: "
            f"median off / median on; *per round*: the range of off/on within a pair. *equal samples*: samples "
            f"whose tokens and log-probs are equal bit for bit between the off and on runs of a round (the "
            f"fewest over the rounds); *off vs off*: the same between the first off run and the later ones, the "
            f"control. In the default numerics (\"fast\") a row's last bits follow the batch it ran in, and "
            f"the first steps' batches follow how fast the requests reached the engine loop, so at temperature 1 "
            f"a sample can take another token even between two runs with the switch off; "
            f"tests/test_async_scheduling.py checks the modes bit for bit with numerics=\"invariant\". Every "
            f"response runs to its length (min_new_tokens = max_new_tokens), as bench/peer_rollout.py does. "
            f"1-minute load at the start: {os.getloadavg()[0]:.2f}.\n\n"
            + markdown_table(["model", "workload", "tokens", "off s", "on s", "speed-up", "per round",
                              "equal samples", "off vs off"], rows)
            + "\n\nModels: " + "; ".join(f"`{k}`: {v.arch}, hidden {v.hidden_size}, {v.num_layers} layers, "
                                         f"{v.num_heads}/{v.num_kv_heads} heads, vocab {v.vocab_size}"
                                         for k, v in SHAPES.items() if k in args.shapes))
    write_result("async_scheduling", "Async scheduling off and on (CPU, interleaved)", body)


if __name__ == "__main__":
    main()
