"""How many steps per (TP degree, batch size) the predictor's step calibration should keep.

    PYTHONPATH=.:bench python bench/calibration_window.py [--repeats 4] [--noise 0.075]

Records real decode steps once (bench/predictor_accuracy.py's runs: the controller benchmark's model,
long-tail batches at TP1xDP2 and TP2xDP1 in turn), then replays the calibrated predictor over them in the
order they ran (``replay_calibration``: each step estimated just before it is recorded) for each
window and ``min_steps``, and reports the per-step MAPE, the first run of each layout apart (it starts
from the other layout's factors or the table's). The same replay with multiplicative log-normal noise of
``--noise`` added to every step stands in for a noisier host, where a longer window would average more.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np

from common import markdown_table, write_result
from cpu_model import DTYPE, PROFILE, WORLD, long_tail_batch, model_path
from pat_engine import Engine
from pat_engine.predictor.step_calibration import CalibrationConfig
from pat_engine.predictor.table import ProfileTable
from predictor_accuracy import mape, replay_calibration, run_layout

CONFIGS = [(4, 2), (8, 3), (8, 4), (16, 3), (32, 4), (64, 4)]  # (window, min_steps)


def replay_errors(table: ProfileTable, order: list[tuple[int, list]], config: CalibrationConfig) -> dict[int, tuple]:
    """Per TP degree: (MAPE over all its steps, over its first run, over the later runs)."""
    online, _ = replay_calibration(table, order, config)
    measured: dict[int, list[np.ndarray]] = {}
    for tp, steps in order:
        measured.setdefault(tp, []).append(np.array([s.seconds for s in steps]))
    out = {}
    for tp, runs in measured.items():
        est = online[tp]
        out[tp] = (mape(np.concatenate(est), np.concatenate(runs)), mape(est[0], runs[0]),
                   mape(np.concatenate(est[1:]), np.concatenate(runs[1:])))
    return out


def noisy(order: list[tuple[int, list]], sigma: float, seed: int) -> list[tuple[int, list]]:
    rng = np.random.default_rng(seed)
    return [(tp, [dataclasses.replace(s, seconds=s.seconds * float(np.exp(rng.normal(0.0, sigma)))) for s in steps])
            for tp, steps in order]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--cap", type=int, default=160)
    p.add_argument("--noise", type=float, default=0.075, help="sigma of the log-normal factor on each step")
    p.add_argument("--noise-seeds", type=int, default=3)
    args = p.parse_args()
    table = ProfileTable.load(PROFILE)
    load_before, started = os.getloadavg(), time.perf_counter()
    order: list[tuple[int, list]] = []
    with Engine(model_path(), tp=1, dp=WORLD, dtype=DTYPE, profile_table=str(PROFILE),
                kv_cache_bytes=1 << 30) as engine:
        for rep in range(args.repeats):
            prompts, lengths = long_tail_batch(args.requests, args.cap, seed=rep)
            for tp in (1, 2) if rep % 2 == 0 else (2, 1):
                order.append((tp, run_layout(engine, tp, prompts, lengths)))
    load_after = os.getloadavg()
    tps = sorted({tp for tp, _ in order})
    rows = []
    for window, min_steps in CONFIGS:
        config = CalibrationConfig(window=window, min_steps=min_steps)
        clean = replay_errors(table, order, config)
        noisy_runs = [replay_errors(table, noisy(order, args.noise, seed), config) for seed in range(args.noise_seeds)]
        row = [f"{window} / {min_steps}" + (" (default)" if config == CalibrationConfig() else "")]
        for tp in tps:
            row.append(" / ".join(f"{x:.2f}%" for x in clean[tp]))
        for tp in tps:
            row.append(f"{np.mean([r[tp][0] for r in noisy_runs]):.2f}%")
        rows.append(row)
    steps = {tp: sum(len(s) for t, s in order if t == tp) for tp in tps}
    body = (f"Model bench/cpu_model.py ({DTYPE}); profile `{os.path.relpath(PROFILE)}`; {args.repeats} long-tail "
            f"batches of {args.requests} requests (response lengths capped at {args.cap}) per layout, layouts in "
            f"turn; decode steps: " + ", ".join(f"TP{tp}xDP{WORLD // tp} {n}" for tp, n in steps.items())
            + f". Recording took {time.perf_counter() - started:.0f} s; load average before/after: "
              f"{load_before[0]:.2f}/{load_after[0]:.2f} (2 cores, shared machine).\n\n"
            + markdown_table(["window / min_steps"]
                             + [f"TP{tp}xDP{WORLD // tp} MAPE: all / first run / later runs" for tp in tps]
                             + [f"TP{tp}xDP{WORLD // tp} with {args.noise:g} log-normal noise (mean of "
                                f"{args.noise_seeds} draws)" for tp in tps], rows)
            + "\n\nEach step is estimated by the calibrated predictor just before it is recorded, replayed in the "
              "order the runs ran (bench/predictor_accuracy.py's `replay_calibration`).\n")
    write_result("calibration_window", "The step calibration's window, replayed over recorded CPU decode steps", body)


if __name__ == "__main__":
    main()
