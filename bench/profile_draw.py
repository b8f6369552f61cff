"""pat-profile's ``--draw``: a table timed greedy beside one timed as an RL rollout draws, each against the
real steps of an RL workload.

    PYTHONPATH=.:csrc:bench:profiler python bench/profile_draw.py [--rounds 2]

Model: peer_rollout's ``qwen-vocab`` shape (Qwen's 151,936-token vocabulary on a hidden-512, 4-layer body:
the draw is a visible share of a step, as on a small model's GPU step), float32, TP1 on one worker.
Each round: ``pat-profile`` (the real path, ``run_profile``) over the same grid with ``--draw greedy`` and
``--draw rl``, in turn (the order swapped every round), then an RL workload through ``Engine.generate``
(16 prompts of 32-192 tokens, temperature 1 with each token's log-prob, response lengths 8-96) with its
decode steps recorded. For every decode step, each table's fitted step at the step's batch and total
context against the measured step: the mean signed error (a bias: greedy leaves the draw out) and the
mean absolute percentage error.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

from common import markdown_table, write_result
from pat_engine import Engine, SamplingParams
from pat_engine.predictor.predictor import LatencyPredictor
from peer_rollout import SHAPES, model_path
from pat_profiler.profile import ProfileOptions, run_profile

SHAPE = "qwen-vocab"
GRID = dict(batches=(1, 4, 16), contexts=(64, 256), window=16, budget_tokens=8192)


def profile(path: str, draw: str, out: Path) -> LatencyPredictor:
    opts = ProfileOptions(model=path, world=1, tps=(1,), dtype="float32", output=str(out), draw=draw,
                          switch_repeats=1, **GRID)
    return LatencyPredictor(run_profile(opts))


def rl_steps(path: str, seed: int) -> list:
    """(batch, total context, seconds) of every decode step of an RL workload, each group's first left out."""
    rng = random.Random(seed)
    vocab = SHAPES[SHAPE].vocab_size
    prompts = [[rng.randrange(16, vocab - 16) for _ in range(rng.randrange(32, 193))] for _ in range(16)]
    params = [SamplingParams(max_new_tokens=rng.randrange(8, 97), ignore_eos=True, temperature=1.0, logprobs=True,
                             seed=i) for i in range(16)]
    engine = Engine(path, tp=1, dtype="float32")
    try:
        with engine.record_steps() as steps:
            engine.generate(prompts, params, use_tqdm=False)
    finally:
        engine.shutdown()
    decode = [s for s in steps if not s.is_prefill]
    return [(s.batch_size, s.context_tokens, s.seconds) for s in decode[1:]]


def errors(pred: LatencyPredictor, steps: list) -> tuple[float, float]:
    """(mean signed error, mean absolute percentage error) of the table's fit against the measured steps."""
    rel = [float(pred.step_seconds(1, b, c)) / s - 1 for b, c, s in steps]
    return statistics.fmean(rel), statistics.fmean(abs(r) for r in rel)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    path = model_path(SHAPE)
    rows, bias = [], {"greedy": [], "rl": []}
    points: dict[tuple[int, int], dict[str, list[float]]] = {}  # (batch, context) -> draw -> decode step s
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            draws = ("greedy", "rl") if r % 2 == 0 else ("rl", "greedy")
            preds = {d: profile(path, d, Path(tmp) / f"{d}_{r}.json") for d in draws}
            for d, pred in preds.items():
                for p in pred.table.points:
                    points.setdefault((p.batch_size, p.context_len), {}).setdefault(d, []).append(p.decode_step_s)
            steps = rl_steps(path, seed=r)
            mean_step = statistics.fmean(s for _, _, s in steps) * 1e3
            for d in ("greedy", "rl"):
                signed, mape = errors(preds[d], steps)
                bias[d].append(signed)
                rows.append([r + 1, d, len(steps), mean_step, f"{signed:+.1%}", f"{mape:.1%}"])
    table = markdown_table(["round", "table's draw", "RL decode steps", "mean measured step ms",
                            "mean signed error", "MAPE"], rows)
    side = markdown_table(["batch", "context", "greedy step ms (median of rounds)", "rl step ms", "rl / greedy"],
                          [[b, c, statistics.median(v["greedy"]) * 1e3, statistics.median(v["rl"]) * 1e3,
                            statistics.median(v["rl"]) / statistics.median(v["greedy"])]
                           for (b, c), v in sorted(points.items())])
    spec = SHAPES[SHAPE]
    body = (f"Model: {SHAPE} (vocab {spec.vocab_size}, hidden {spec.hidden_size}, {spec.num_layers} layers), "
            f"float32, TP1, one worker. Grid: batches {GRID['batches']}, contexts {GRID['contexts']}, "
            f"{GRID['window']} decode steps a point. Workload: 16 prompts of 32-192 tokens, temperature 1 with "
            f"log-probs, 8-96 new tokens each; every decode step but the first, each table's fit at the step's "
            f"batch and total context against the measured step.\n\n{table}\n\n"
            f"The two tables' points side by side (what the draw adds to a step on this machine):\n\n{side}\n\n"
            f"Median signed error over the rounds: greedy table {statistics.median(bias['greedy']):+.1%}, "
            f"rl table {statistics.median(bias['rl']):+.1%}.")
    write_result("profile_draw", "pat-profile --draw: greedy and RL tables against an RL workload", body)


if __name__ == "__main__":
    main()
