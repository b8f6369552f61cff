"""End to end on CPU: the controller, driven by the measured profile, switches on a long-tail batch.

    PYTHONPATH=.:profiler python bench/controller_e2e.py [--requests 16] [--repeats 2]

Engine(profile_table=bench/profiles/...) attaches the controller; the batch
(ragged prompts, long-tail response lengths with one straggler) starts at
TP1xDP2. The same batch also runs static at TP1xDP2 and at TP2xDP1, and under
a second controller that prices with the table alone (``calibrate_profile=False``;
the engine's own corrects the table with the steps it has seen,
pat_engine/predictor/step_calibration.py). Runs alternate (static TP1,
controller, table alone, static TP2, ...) so drifts of a shared machine hit all; the prefix cache is
flushed before each, so every run prefills its prompts. Reports generation times side by side, their ratios, every
switch the controller made with the predicted remaining times behind it, and
checks the tokens equal the static runs'.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import time


from common import markdown_table, write_result
from cpu_model import DTYPE, PROFILE, WORLD, long_tail_batch, model_path
from pat_engine import Engine, SamplingParams
from pat_engine.core.controller_setup import kv_capacity_check
from pat_engine.predictor.policy import StaticLayout
from pat_engine.predictor.setup import build_controller
from pat_engine.predictor.table import ProfileTable


def timed(engine: Engine, prompts, params, policy, cost_source, start_tp: int = 1):
    engine.reconfigure(start_tp)
    # Every run prefills its prompts: a run that starts where the last one ended would otherwise find them in
    # the prefix cache, one after a real reconfigure would not (a switch keeps only its requests' blocks).
    engine.flush_cache()
    engine.set_policy(policy, cost_source)
    before = len(engine.switches)
    t = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, [o.token_ids for o in outs], engine.switches[before:]


@contextlib.contextmanager
def timed_decisions(policy):
    """Host seconds the policy's ``decide`` takes while the block runs (the list's one element)."""
    spent, decide = [0.0], policy.decide

    def timed_decide(status):
        t = time.perf_counter()
        try:
            return decide(status)
        finally:
            spent[0] += time.perf_counter() - t

    policy.decide = timed_decide
    try:
        yield spent
    finally:
        del policy.decide


def first_evaluations(checks: dict[str, list]) -> list[str]:
    lines = []
    for label, runs in checks.items():
        for i, evaluations in enumerate(runs):
            for ev in evaluations:
                d = ev.details
                lines.append(f"- {label}, run {i + 1}, step {ev.stage_step}, {ev.active} active: stay "
                             f"{d['stay_s']:.2f} s, plans {json.dumps(d['plan_s'])}, deferred "
                             f"{json.dumps(d.get('best_deferred'))}, calibration {d.get('calibration', '-')}: "
                             f"TP{ev.chosen_tp}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--cap", type=int, default=384)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=3)
    args = p.parse_args()
    prompts, lengths = long_tail_batch(args.requests, args.cap, args.seed, (32, 128), straggler=True)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in lengths]
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {"static TP1xDP2": [], "controller": [], "controller, table alone": [],
                                     "static TP2xDP1": []}
    tokens: dict[str, list] = {}
    events: dict[str, list] = {"controller": [], "controller, table alone": []}
    first_checks: dict[str, list] = {"controller": [], "controller, table alone": []}
    host: dict[str, list] = {"controller": [], "controller, table alone": []}  # per run: evaluations, unpriced, s
    with Engine(model_path(), tp=1, dp=WORLD, dtype=DTYPE, profile_table=str(PROFILE),
                kv_cache_bytes=1 << 30) as engine:
        controller = engine.policy
        assert controller is not None, "the profile table did not attach a controller"
        alone = build_controller(engine.arch, dataclasses.replace(engine.config, calibrate_profile=False),
                                 kv_capacity_check(engine.arch, WORLD, engine.memory), ProfileTable.load(PROFILE))
        controllers = {"controller": controller, "controller, table alone": alone}
        for _ in range(args.repeats):
            for label in times:
                if label in controllers:
                    policy = controllers[label]
                    seen, skipped = len(policy.history), policy.skipped
                    with timed_decisions(policy) as spent:
                        secs, toks, evs = timed(engine, prompts, params, policy, policy.predictor, 1)
                    events[label].append(evs)
                    first_checks[label].append(policy.history[seen:seen + 3])
                    host[label].append((len(policy.history) - seen, policy.skipped - skipped, spent[0]))
                else:  # the engine's controller learns from these steps too, as it would in service
                    secs, toks, _ = timed(engine, prompts, params, StaticLayout(), controller.predictor,
                                          1 if "TP1" in label else 2)
                times[label].append(secs)
                tokens.setdefault(label, toks)
                assert toks == tokens[label], f"{label}: tokens changed between repeats"
    load_after = os.getloadavg()
    same = all(toks == tokens["static TP1xDP2"] for toks in tokens.values())
    base = statistics.fmean(times["static TP1xDP2"])
    rows = [[label, " / ".join(f"{t:.2f}" for t in ts), f"{statistics.fmean(ts):.2f}",
             f"{statistics.fmean(ts) / base:.3f}"] for label, ts in times.items()]
    lines = []
    for label, runs in events.items():
        for i, evs in enumerate(runs):
            lines += [f"- {label}, run {i + 1}: none"] if not evs else []
            for ev in evs:
                d = ev.decision
                lines.append(f"- {label}, run {i + 1}: t={ev.t:.1f}s {ev.from_layout} -> {ev.to_layout} ({ev.kv_path}, "
                             f"measured {ev.seconds * 1e3:.0f} ms) at stage step {d.get('stage_decode_step')}, "
                             f"{d.get('active')} active; predicted remaining "
                             f"{json.dumps(d.get('remaining_s'))} s, switch cost "
                             f"{json.dumps({k: round(v['total_s'], 4) for k, v in d.get('switch_cost_s', {}).items()})}"
                             f" s, gain {d.get('predicted_gain_s')} s")
    body = (f"Model bench/cpu_model.py ({DTYPE}, world {WORLD}); profile `{os.path.relpath(PROFILE)}`; "
            f"{args.requests} requests, response lengths {sorted(lengths, reverse=True)} (ignore_eos), "
            f"prompts 32-127 tokens. Runs alternate; {args.repeats} repeats each.\n"
            f"Load average before/after: {load_before[0]:.2f}/{load_after[0]:.2f} (2 cores, shared machine).\n\n"
            + markdown_table(["run", "generation seconds (each repeat)", "mean", "ratio to static TP1xDP2"], rows)
            + f"\n\nTokens identical across both controllers and both static runs: **{same}**\n\n"
            + "Switches the controllers made (the engine's SwitchEvent and its decision details):\n\n"
            + ("\n".join(lines) or "- none") + "\n\n"
            + "Each controller run's first three evaluations (stage step, requests, predicted seconds: staying, "
              "each switch plan; the best deferred plan; the calibrated predictor's median factor on the current layout; the choice):\n\n"
            + "\n".join(first_evaluations(first_checks)) + "\n\n"
            + "The controllers' host time, per run (evaluations priced, checks left unpriced by a clear stay, "
              "seconds in `decide`):\n\n"
            + "\n".join(f"- {label}, run {i + 1}: {n} evaluations, {k} unpriced, {t:.2f} s"
                        for label, runs in host.items() for i, (n, k, t) in enumerate(runs)) + "\n")
    write_result("controller_e2e", "Controller end to end on CPU workers", body)
    if not same:
        raise SystemExit("tokens differ between the controller run and the static runs")


if __name__ == "__main__":
    main()
