"""Predictor accuracy on real CPU trajectories (paper Sec. 5.5, Fig. 14).

    PYTHONPATH=.:profiler python bench/predictor_accuracy.py [--requests 32] [--repeats 2]

Loads the committed profile of the benchmark model (bench/profiles/, made by
pat-profile from random-token dummy batches), runs ragged batches (random
prompt lengths, long-tail response lengths) at TP1xDP2 and TP2xDP1 with
``engine.record_steps()``, and compares, for every decode step as the batch
drains, the predicted step latency (fit at the step's batch size and total
context) with the measured one. Layouts alternate (A B A B ...) so slow
drifts of a shared machine hit both. Reports the mean absolute percentage
error per layout: per step, per window of 8 steps (the controller's check
interval), and of the whole drain time, for the table alone and for the
engine's predictor, which corrects the table with the steps it has seen
(replayed over the recorded steps in order); plus a PNG of the trajectories.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from common import RESULTS, markdown_table, write_result
from cpu_model import DTYPE, PROFILE, WORLD, long_tail_batch, model_path
from pat_engine import Engine, SamplingParams
from pat_engine.predictor.policy import StaticLayout
from pat_engine.predictor.predictor import LatencyPredictor
from pat_engine.predictor.step_calibration import CalibrationConfig
from pat_engine.predictor.table import ProfileTable


def run_layout(engine: Engine, tp: int, prompts, lengths) -> list:
    engine.reconfigure(tp)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in lengths]
    with engine.record_steps() as steps:
        engine.generate(prompts, params, policy=StaticLayout(), use_tqdm=False)
    first: set[int] = set()
    out = []
    for s in steps:  # like the profiler: drop each group's first decode step (it overlaps prefills)
        if s.is_prefill:
            continue
        if s.group not in first:
            first.add(s.group)
            continue
        out.append(s)
    return out


def replay_calibration(table: ProfileTable, runs: list[tuple[int, list]], config: CalibrationConfig = CalibrationConfig()
                       ) -> tuple[dict[int, list[np.ndarray]], dict[int, list[np.ndarray]]]:
    """The engine's calibrated predictor (``step_calibration.py``) over recorded runs, ``(tp, steps)`` in the
    order they ran, learning from each step as the engine does. Returns, per TP degree, per run of it in
    order: every step's estimate made just before that step was recorded, and every step's estimate as the
    run began (what a controller pricing the whole drain then would have used; the first run's: the table's)."""
    pred = LatencyPredictor(table, calibration=config)
    online: dict[int, list[np.ndarray]] = {}
    at_start: dict[int, list[np.ndarray]] = {}
    for tp, steps in runs:
        at_start.setdefault(tp, []).append(
            np.array([float(pred.step_seconds(tp, s.batch_size, s.context_tokens)) for s in steps]))
        est = []
        for s in steps:
            est.append(pred.step_scalar(tp, s.batch_size, s.context_tokens))
            pred.record_decode_step(tp, s.batch_size, s.context_tokens, s.seconds)
        online.setdefault(tp, []).append(np.array(est))
    return online, at_start


def ratio_by_batch(pred: LatencyPredictor, records: dict[int, list]) -> list[list]:
    """Rows [batch size, then per TP degree the median measured / table fit and its steps]: how the table's
    error depends on the batch (why the calibration keeps a factor per batch size)."""
    ratios: dict[tuple[int, int], list[float]] = {}
    for tp, runs in records.items():
        for s in (s for run in runs for s in run):
            fit = float(pred.step_seconds(tp, s.batch_size, s.context_tokens))
            ratios.setdefault((tp, s.batch_size), []).append(s.seconds / fit)
    sizes = sorted({b for _, b in ratios})
    return [[b] + [f"{statistics.median(ratios[tp, b]):.2f} ({len(ratios[tp, b])})" if (tp, b) in ratios else "-"
                   for tp in records] for b in sizes]


def drain_error(est: list[np.ndarray], meas: list[np.ndarray]) -> float:
    """Mean over runs of |predicted - measured| / measured of the run's summed decode steps, in %."""
    return statistics.fmean(abs(e.sum() - m.sum()) / m.sum() * 100 for e, m in zip(est, meas))


def mape(pred: np.ndarray, meas: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - meas) / meas) * 100)


def step_noise(runs: list[list]) -> float:
    """How far a step is from its neighbours (same group and batch size, up to 4 steps either side):
    the MAPE that a predictor knowing the true local mean would still have on single steps."""
    errs = []
    for run in runs:
        for g in {s.group for s in run}:
            steps = [s for s in run if s.group == g]
            for i, s in enumerate(steps):
                near = [o.seconds for o in steps[max(i - 4, 0): i + 5] if o is not s and o.batch_size == s.batch_size]
                if near:
                    errs.append(abs(statistics.fmean(near) - s.seconds) / s.seconds * 100)
    return statistics.fmean(errs)


def table_repeatability(table: ProfileTable) -> dict[int, float]:
    """Per TP: mean |difference| between passes of the same profile point, relative to their mean (needs
    ``pat-profile --passes 2`` or more): how well this machine reproduces its own step latency."""
    by: dict[tuple, list[float]] = {}
    for p in table.points:
        by.setdefault(p.key, []).append(p.decode_step_s)
    out: dict[int, list[float]] = {}
    for (tp, _, _), ys in by.items():
        if len(ys) > 1:
            out.setdefault(tp, []).append((max(ys) - min(ys)) / statistics.fmean(ys) * 100)
    return {tp: statistics.fmean(v) for tp, v in out.items()}


def windows(pred: np.ndarray, meas: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    n = len(meas) // k * k
    return pred[:n].reshape(-1, k).mean(axis=1), meas[:n].reshape(-1, k).mean(axis=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--cap", type=int, default=160)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", default=str(PROFILE))
    args = p.parse_args()
    table = ProfileTable.load(args.profile)
    pred = LatencyPredictor(table, calibration=None)  # the table alone
    load_before = os.getloadavg()
    started = time.perf_counter()
    records: dict[int, list] = {1: [], 2: []}
    order: list[tuple[int, list]] = []  # every run as it ran, for the calibration's replay
    with Engine(model_path(), tp=1, dp=WORLD, dtype=DTYPE, profile_table=args.profile,
                kv_cache_bytes=1 << 30) as engine:
        for rep in range(args.repeats):
            prompts, lengths = long_tail_batch(args.requests, args.cap, seed=rep)
            for tp in (1, 2) if rep % 2 == 0 else (2, 1):
                records[tp].append(run_layout(engine, tp, prompts, lengths))
                order.append((tp, records[tp][-1]))
    load_after = os.getloadavg()
    repeat = table_repeatability(table)
    online, at_start = replay_calibration(table, order)
    rows, curves = [], {}
    for tp, runs in records.items():
        meas_runs = [np.array([s.seconds for s in run]) for run in runs]
        est_runs = [np.array([float(pred.step_seconds(tp, s.batch_size, s.context_tokens)) for s in run])
                    for run in runs]
        meas, est = np.concatenate(meas_runs), np.concatenate(est_runs)
        cal = np.concatenate(online[tp])
        wp, wm = windows(est, meas, 8)
        rows.append([f"TP{tp}xDP{WORLD // tp}", len(meas), f"{mape(est, meas):.2f}%", f"{mape(cal, meas):.2f}%",
                     f"{mape(wp, wm):.2f}%", f"{drain_error(est_runs, meas_runs):.2f}%",
                     f"{drain_error(at_start[tp], meas_runs):.2f}%", f"{step_noise(runs):.2f}%",
                     f"{repeat[tp]:.2f}%" if tp in repeat else "n/a", f"{np.mean(meas) * 1e3:.1f}"])
        curves[tp] = (runs[0], pred)
    png = RESULTS / "predictor_accuracy.png"
    plot(curves, png)
    body = (f"Profile: `{os.path.relpath(args.profile)}` ({len(table.points)} points from random-token dummy "
            f"batches, {table.deployment.device}, {table.deployment.dtype}); model: bench/cpu_model.py; "
            f"{args.requests} requests per batch, prompts 32-96 tokens, long-tail response lengths capped at "
            f"{args.cap} (bench/longtail/workload.py, scaled); {args.repeats} batches per layout, layouts "
            f"alternating. Decode steps only; each group's first decode step left out (as in the profile).\n"
            f"Load average before/after: {load_before[0]:.2f}/{load_after[0]:.2f} (2 cores; other jobs share "
            f"this machine). Wall time {time.perf_counter() - started:.0f} s.\n\n"
            + markdown_table(["layout", "decode steps", "MAPE per step, table", "MAPE per step, calibrated",
                              "MAPE per 8-step window, table", "drain time error, table",
                              "drain time error, calibrated", "step noise", "table repeatability",
                              "mean step (ms)"], rows)
            + "\n\nThe table's error by batch size (median measured / fitted, steps in brackets):\n\n"
            + markdown_table(["batch per group"] + [f"TP{tp}xDP{WORLD // tp}" for tp in records],
                             ratio_by_batch(pred, records))
            + "\n\n*Step noise*: a step's distance from the mean of its neighbours (same group and batch size, "
              "up to 4 steps either side), i.e. the per-step MAPE that even a predictor of the true local mean "
              "would have. *Table repeatability*: the same profile point measured in two passes of the grid "
              "(`pat-profile --passes 2`, minutes apart), mean |difference| relative to their mean: how "
              "well this machine reproduces its own latency. *Drain time error*: predicted vs measured sum of the decode steps of a whole batch "
              "(the quantity the controller compares between layouts). *Calibrated*: the engine's predictor, "
              "which corrects the table with the steps it has seen (pat_engine/predictor/step_calibration.py), "
              "replayed over the recorded steps in the order they ran: per step, its estimate just before that "
              "step; per drain, the run's steps as estimated when the run began (the first run's: the table's)."
              "\n\nBefore the engine padded CPU GEMM rows to a "
              "multiple of 4 (commit 2b57540), odd batch sizes ran up to 2x slower than the powers of two the "
              "table holds, and this benchmark gave 26.7% (TP1xDP2) and 23.0% (TP2xDP1) per step.\n\nPaper (Sec. 5.5, DeepScaleR, 8xA40): 4.04% (TP2xDP4) and 3.07% (TP8xDP1).\n\n"
            + f"![trajectories]({png.name})\n")
    write_result("predictor_accuracy", "Predictor accuracy on real CPU trajectories", body)


def plot(curves: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(11, 3.6), squeeze=False)
    for ax, (tp, (run, pred)) in zip(axes[0], sorted(curves.items())):
        for g in sorted({s.group for s in run}):
            steps = [s for s in run if s.group == g]
            t = [s.t for s in steps]
            ax.plot(t, [s.seconds * 1e3 for s in steps], lw=0.6, alpha=0.6, label=f"measured, group {g}")
            ax.plot(t, [float(pred.step_seconds(tp, s.batch_size, s.context_tokens)) * 1e3 for s in steps],
                    lw=1.4, label=f"predicted, group {g}")
        ax2 = ax.twinx()
        ax2.step([s.t for s in run], [s.batch_size for s in run], where="post", color="gray", lw=0.8)
        ax2.set_ylabel("batch (per group)", color="gray")
        ax.set_title(f"TP{tp}xDP{WORLD // tp}: decode step latency as the batch drains", fontsize=9)
        ax.set_xlabel("seconds")
        ax.set_ylabel("ms per step")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
