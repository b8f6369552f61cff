"""Part ``controller``: the controller on ranks sharing one GPU (issue 32, item 4).

``pat-profile`` measures this very deployment (world 2 on one device: the table says "2 ranks per device",
so no one-GPU-per-rank engine can take it), then a long-tail batch (most responses short, a few long) runs
static at TP1xDP2, static at TP2xDP1 and under the controller that table drives, layouts in turn (each run
that starts at TP1 after an untimed one there, so that no timed run captures decode graphs the others do
not).

What one device can show: the ranks share one HBM and co-located TP>1 groups decode eagerly, their
collectives waiting on the host, so a switch cannot win time here. The checks are that the predictor, fitted to
the table, predicts this GPU's decode steps (goal: <= 5% per step) and that the controller picks what its
table says at every evaluation (its recorded predictions: a switch exactly when one beat staying by the
margin). The model and deployment are the ``switch`` part's (the 1B shape, two ranks on the device); this
part runs in a process of its own, so a fault or a timeout in either costs the other nothing.
"""

from __future__ import annotations

import bisect
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common import markdown_table
from gpucheck.report import PartResult
from gpucheck.shared import Ctx, log, verdict
from predictor_accuracy import drain_error, mape, replay_calibration, run_layout, step_noise

STEP_ERROR_GOAL = 0.05
ROOT = Path(__file__).resolve().parents[2]


def profile_argv(ctx: Ctx, ckpt: Path, out: Path) -> list[str]:
    """pat-profile on the part's co-located deployment (world 2, TP 1 and 2), graphs as the engine runs them.
    Two passes over the grid: the fourth run's one pass left TP2 points 30-42 ms in no order of batch or
    context, and its drain-time error (15%, which the steps' noise averages away) near its per-step error
    (19%): a table point's own slow or fast spell, which a second pass minutes later averages."""
    base = ["--model", str(ckpt), "--world", "2", "--tp", "1", "2", "--dtype", "bfloat16", "--output", str(out)]
    if ctx.smoke:
        return base + ["--device", "cpu", "--graph-backend", "standin", "--batch-sizes", "1", "2", "4",
                       "--context-lens", "16", "48", "--decode-window", "4", "--kv-budget-tokens", "512"]
    return base + ["--device", "cuda", "--batch-sizes", "1", "2", "4", "8", "16", "--context-lens", "256", "1024",
                   "--decode-window", "24", "--kv-budget-tokens", "32768", "--passes", "2"]


def long_tail(ctx: Ctx, vocab: int) -> tuple[list[list[int]], list[int]]:
    """Prompts and exact response lengths: most requests short, the last few long (the tail)."""
    n, prompt, short, long, tail = (6, 16, 4, 24, 2) if ctx.smoke else (24, 256, 32, 480, 3)
    rng = np.random.default_rng(4)
    prompts = rng.integers(16, min(vocab, 30000) - 1, (n, prompt)).tolist()
    return prompts, [short + i % 8 for i in range(n - tail)] + [long] * tail


def table_agreement(history) -> tuple[int, list[list]]:
    """How many evaluations chose what their own predictions say (switch to the best plan exactly when it beat
    staying by the margin), and a row per evaluation."""
    rows, agree = [], 0
    for ev in history:
        d = ev.details
        plans = {int(tp): t for tp, t in d["plan_s"].items()}
        best = min((tp for tp in plans if tp != ev.current_tp), key=plans.get, default=ev.current_tp)
        says = best if d["stay_s"] - plans.get(best, d["stay_s"]) > d["margin_s"] else ev.current_tp
        deferred = ev.chosen_tp == ev.current_tp and ("best_deferred" in d or "same_switch_later_s" in d)
        agree += says == ev.chosen_tp or deferred
        rows.append([ev.stage_step, ev.active, f"TP{ev.current_tp}",
                     ", ".join(f"TP{tp} {t:.3f}" for tp, t in sorted(plans.items())), f"{d['margin_s']:.3f}",
                     f"TP{ev.chosen_tp}", "yes" if says == ev.chosen_tp else "deferred" if deferred else "NO"])
    return agree, rows


def warm_tp1(engine, prompts: list[list[int]], params: list) -> None:
    """Switch to TP1xDP2 and run the batch once, statically: TP1 groups replay decode graphs, which a switch
    drops and the first step of each batch size captures again (~50-100 ms on a GPU against a few ms a
    step); co-located TP2 groups decode eagerly. So no timed run, and no recorded step, pays for a capture
    the other runs do not."""
    from pat_engine.predictor.policy import StaticLayout

    engine.reconfigure(1)
    engine.generate(prompts, params, policy=StaticLayout(), use_tqdm=False)


@dataclass(frozen=True)
class LayoutSteps:
    """One layout's static runs, each step once, in the runs' order: measured seconds, the table's fit
    (``predicted``), the engine's calibrated predictor (``calibrated``: each step's estimate just before it,
    replayed in the order every run ran; ``at_start``: per run, its steps as estimated when it began), and the
    share of each step another DP group's steps ran (``overlapped``)."""

    runs: list[list]
    measured: np.ndarray
    predicted: np.ndarray
    calibrated: np.ndarray
    at_start: list[np.ndarray]
    overlap: np.ndarray

    @classmethod
    def of(cls, pred, tp: int, runs: list[list], calibrated: list[np.ndarray],
           at_start: list[np.ndarray]) -> "LayoutSteps":
        steps = [s for run in runs for s in run]
        return cls(runs, np.array([s.seconds for s in steps]),
                   np.array([float(pred.step_seconds(tp, s.batch_size, s.context_tokens)) for s in steps]),
                   np.concatenate(calibrated), at_start, np.array([f for run in runs for f in overlapped(run)]))

    def split(self, values: np.ndarray) -> list[np.ndarray]:
        """``values`` (one per step) cut into the runs."""
        return np.split(values, np.cumsum([len(run) for run in self.runs])[:-1])


def step_errors(steps: LayoutSteps) -> dict[str, float]:
    """The predictor on one layout's static runs, in %: per-step MAPE, its median signed error (the table's
    bias: a constant the table misses, e.g. the driver's round trip), the steps' own noise (the MAPE a
    predictor knowing each step's local mean would still have) and the drain-time error. MAPE well above
    the noise with a bias near it says the table is off; MAPE near the noise says the steps are.

    With several DP groups on the device, also the MAPE of the steps that another group's steps overlapped for
    at least half their time (``shared``) and of the others (``alone``): the table's points ran every group at
    once, so a step alone on the device may run faster than its point (None where there were none).

    The same three for the engine's calibrated predictor (``calibrated_*``; its drain-time error from each run's
    steps as estimated when the run began): the predictor the controller decides with."""
    meas, est, cal, shared = steps.measured, steps.predicted, steps.calibrated, steps.overlap >= 0.5
    runs = steps.split(meas)
    return {"mape": mape(est, meas), "bias": float(np.median(est / meas - 1) * 100), "noise": step_noise(steps.runs),
            "drain": drain_error(steps.split(est), runs),
            "calibrated_mape": mape(cal, meas), "calibrated_bias": float(np.median(cal / meas - 1) * 100),
            "calibrated_drain": drain_error(steps.at_start, runs),
            "shared": mape(est[shared], meas[shared]) if shared.any() else None,
            "alone": mape(est[~shared], meas[~shared]) if (~shared).any() else None,
            "alone_steps": int((~shared).sum())}


def overlapped(run: list) -> list[float]:
    """Per step of one run: the share of its time (dispatch to result) another group's steps were running.
    A group's own steps follow one another, so each group's spans, sorted by start, are sorted by end too."""
    by_group: dict[int, list[tuple[float, float]]] = {}
    for s in run:
        by_group.setdefault(s.group, []).append((s.t - s.seconds, s.t))
    for spans in by_group.values():
        spans.sort()
    ends = {g: [e for _, e in spans] for g, spans in by_group.items()}
    out = []
    for s in run:
        start, end = s.t - s.seconds, s.t
        covered = 0.0
        for g, spans in by_group.items():
            if g == s.group:
                continue
            i = bisect.bisect_right(ends[g], start)  # the first of g's steps still running at `start`
            while i < len(spans) and spans[i][0] < end:
                covered += min(end, spans[i][1]) - max(start, spans[i][0])
                i += 1
        out.append(min(1.0, covered / (end - start)) if end > start else 0.0)
    return out


def step_records(steps: LayoutSteps) -> list[list]:
    """[batch, context tokens, measured ms, the table's ms, the calibrated predictor's ms, group, share of it
    another group ran, completion s] of every step, for analysis after the device is gone."""
    flat = [s for run in steps.runs for s in run]
    return [[s.batch_size, s.context_tokens, round(s.seconds * 1e3, 4), round(float(est) * 1e3, 4),
             round(float(cal) * 1e3, 4), s.group, round(float(f), 3), round(s.t, 6)]
            for s, est, cal, f in zip(flat, steps.predicted, steps.calibrated, steps.overlap)]


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}%"


def run(ctx: Ctx) -> PartResult:
    from gpucheck.switch import engine_kwargs, part_checkpoint

    _, ckpt = part_checkpoint(ctx)
    lines, headlines, data = measure(ctx, ckpt, engine_kwargs(ctx.device, ctx.smoke))
    return PartResult("\n".join(lines), headlines, data)


def measure(ctx: Ctx, ckpt: Path, engine_kwargs: dict) -> tuple[list[str], list[str], dict]:
    """(section lines, headlines, data)."""
    from pat_engine import Engine, SamplingParams
    from pat_engine.model.arch import load_model_arch
    from pat_engine.predictor.predictor import LatencyPredictor
    from pat_engine.predictor.table import ProfileTable

    table_path = ctx.workdir / ("switch_profile_smoke.json" if ctx.smoke else "switch_profile_colocated.json")
    table_path.unlink(missing_ok=True)
    argv = profile_argv(ctx, ckpt, table_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "TQDM_DISABLE": "1"}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pat_profiler.cli", *argv], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    profile_s = time.perf_counter() - t
    shown = "pat-profile " + " ".join(shlex.quote(a) for a in argv)
    if proc.returncode != 0:
        raise RuntimeError(f"`{shown}` exited {proc.returncode} after {profile_s:.0f}s:\n{proc.stderr[-3000:]}")
    table = ProfileTable.load(table_path)
    pred = LatencyPredictor(table, calibration=None)  # the table alone
    log(f"co-located profile: {len(table.points)} points in {profile_s:.0f}s ({table.deployment.device})")

    prompts, lengths = long_tail(ctx, load_model_arch(str(ckpt)).vocab_size)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in lengths]
    times: dict[str, list[float]] = {"static TP1xDP2": [], "static TP2xDP1": [], "controller": []}
    steps: dict[int, list[list]] = {1: [], 2: []}  # tp -> each static run's decode steps
    order: list[tuple[int, list]] = []  # the static runs as they ran, for the calibration's replay
    events, history = [], []
    unpriced = 0  # checks that found the controller's last clear stay standing
    with Engine(str(ckpt), tp=1, dp=2, profile_table=str(table_path), **engine_kwargs) as engine:
        controller = engine.policy
        assert controller is not None, "the table did not attach a controller"
        for _ in range(1 if ctx.smoke else 2):
            for label in times:
                if label != "static TP2xDP1":  # runs starting at TP1: every batch size's graph captured untimed
                    warm_tp1(engine, prompts, params)
                t = time.perf_counter()
                if label == "controller":
                    engine.set_policy(controller)
                    before, seen, skipped = len(engine.switches), len(controller.history), controller.skipped
                    engine.generate(prompts, params, use_tqdm=False)
                    events += engine.switches[before:]
                    history += controller.history[seen:]
                    unpriced += controller.skipped - skipped
                else:
                    tp = 1 if "TP1" in label else 2
                    steps[tp].append(run_layout(engine, tp, prompts, lengths))
                    order.append((tp, steps[tp][-1]))
                times[label].append(time.perf_counter() - t)
    online, at_start = replay_calibration(table, order)
    per_layout = {tp: LayoutSteps.of(pred, tp, runs, online[tp], at_start[tp]) for tp, runs in steps.items()}
    errors = {tp: step_errors(s) for tp, s in per_layout.items()}
    agree, eval_rows = table_agreement(history)
    mean = {label: statistics.fmean(ts) for label, ts in times.items()}
    best_static = min(("static TP1xDP2", "static TP2xDP1"), key=mean.get)
    worst_step = max(e["calibrated_mape"] for e in errors.values())
    switches = "; ".join(f"{e.from_layout} -> {e.to_layout} at stage step {e.decision.get('stage_decode_step')}"
                         for e in events) or "none (stayed at TP1xDP2)"
    lines = [
        f"`{shown}` ({profile_s:.0f} s, {len(table.points)} points; deployment device "
        f"\"{table.deployment.device}\"). Batch: {len(prompts)} requests of {len(prompts[0])} prompt tokens, "
        f"{len(lengths) - lengths.count(max(lengths))} short responses ({min(lengths)}-"
        f"{max(x for x in lengths if x != max(lengths))} tokens) and {lengths.count(max(lengths))} of "
        f"{max(lengths)} (ignore_eos, greedy); static and controller runs in turn, {len(times['controller'])} "
        "round(s).",
        "",
        "**On one device a switch cannot win time**: the ranks share one HBM, and a co-located TP2 group decodes "
        "eagerly, its collectives waiting on the host. What is checked: the predictor's error on this GPU's "
        "steps, and that the controller picks what its table says.",
        "",
        markdown_table(["run", "seconds (each round)", "mean s", "vs best static"],
                       [[label, " / ".join(f"{t:.2f}" for t in ts), mean[label], mean[label] / mean[best_static]]
                        for label, ts in times.items()]),
        "",
        f"Controller's switches: {switches}.",
        "",
        markdown_table(["layout", "decode steps", "per-step error (MAPE): table / calibrated",
                        "median signed error (bias): table / calibrated", "steps' own noise",
                        "drain-time error: table / calibrated", "MAPE (table), another group busy",
                        "MAPE (table), alone (steps)"],
                       [[f"TP{tp}xDP{2 // tp}", sum(map(len, steps[tp])),
                         f"{e['mape']:.2f}% / {e['calibrated_mape']:.2f}%",
                         f"{e['bias']:+.2f}% / {e['calibrated_bias']:+.2f}%", f"{e['noise']:.2f}%",
                         f"{e['drain']:.2f}% / {e['calibrated_drain']:.2f}%", pct(e["shared"]),
                         f"{pct(e['alone'])} ({e['alone_steps']})"] for tp, e in errors.items()]),
        "",
        "*Table*: the fit of the table alone. *Calibrated*: the engine's predictor, which corrects that fit with "
        "the decode steps it has seen (pat_engine/predictor/step_calibration.py), replayed over the static runs' "
        "steps in the order they ran (the engine also learned from the untimed and the controller's runs): a "
        "step's estimate just before it; a drain's, as its run began. The controller decides with it.",
        "",
        "The steps' own noise: the MAPE that a predictor knowing each step's local mean (its group's steps of the "
        "same batch size, up to 4 either side) would still have. *Another group busy* / *alone*: the steps the "
        "other DP group's steps overlapped for at least half their time, and the others (the table's points ran "
        "both groups at once). The raw steps are in the JSON beside this file (`data.steps`: batch, context "
        "tokens, measured ms, the table's and the calibrated predictor's ms, group, the share of the step another group ran, completion time).",
        "",
        "Every evaluation of the controller (predicted totals in seconds: staying, or switching now with the "
        "switch cost; the table says switch when the best plan beats staying by the margin; \"deferred\": the "
        "lookahead priced the same switch later as better):",
        "",
        markdown_table(["stage step", "active", "at", "predicted totals", "margin s", "chose", "as the table says"],
                       eval_rows),
    ]
    headlines = [
        f"controller on the co-located GPU: {switches}; {mean['controller']:.2f} s vs best static "
        f"({best_static}) {mean[best_static]:.2f} s; picks what its table says at {agree} of {len(history)} "
        f"evaluations ({unpriced} more checks left unpriced: clear stays)",
        f"predictor step error on this GPU (calibrated, as the controller uses it): worst {worst_step:.1f}% per "
        f"step (goal <= {STEP_ERROR_GOAL:.0%}: {verdict(worst_step <= STEP_ERROR_GOAL * 100)}); the table alone "
        + ", ".join(f"TP{tp} {e['mape']:.1f}%" for tp, e in errors.items()) + "; drain-time calibrated "
        + ", ".join(f"TP{tp} {e['calibrated_drain']:.1f}%" for tp, e in errors.items()) + ", table "
        + ", ".join(f"TP{tp} {e['drain']:.1f}%" for tp, e in errors.items()) + "; bias (table) "
        + ", ".join(f"TP{tp} {e['bias']:+.1f}%" for tp, e in errors.items()) + ", steps' own noise "
        + ", ".join(f"TP{tp} {e['noise']:.1f}%" for tp, e in errors.items())
        + f"; TP1 steps another group overlapped {pct(errors[1]['shared'])}, alone {pct(errors[1]['alone'])} "
        f"({errors[1]['alone_steps']} steps)",
    ]
    if ctx.smoke:
        headlines = ["smoke: controller not judged (CPU)"]
    data = {"times": times, "errors": {str(tp): e for tp, e in errors.items()},
            "steps": {str(tp): step_records(s) for tp, s in per_layout.items()},
            "switches": [f"{e.from_layout}->{e.to_layout}" for e in events], "agree": agree,
            "evaluations": len(history), "unpriced_checks": unpriced}
    return lines, headlines, data
