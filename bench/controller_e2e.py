"""End to end on CPU: the controller, driven by the measured profile, switches on a long-tail batch.

    PYTHONPATH=.:profiler python bench/controller_e2e.py [--requests 16] [--repeats 2]

Engine(profile_table=bench/profiles/...) attaches the controller; the batch
(ragged prompts, long-tail response lengths with one straggler) starts at
TP1xDP2. The same batch also runs static at TP1xDP2 and at TP2xDP1. Runs
alternate (static TP1, controller, static TP2, ...) so drifts of a shared
machine hit all. Reports generation times side by side, their ratios, every
switch the controller made with the predicted remaining times behind it, and
checks the tokens equal the static runs'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


from common import markdown_table, write_result
from cpu_model import DTYPE, PROFILE, WORLD, long_tail_batch, model_path
from pat_engine import Engine, SamplingParams
from pat_engine.predictor.policy import StaticLayout


def timed(engine: Engine, prompts, params, policy=None, start_tp: int = 1):
    engine.reconfigure(start_tp)
    if policy is not None:
        engine.set_policy(policy)
    before = len(engine.switches)
    t = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, [o.token_ids for o in outs], engine.switches[before:]


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
    times: dict[str, list[float]] = {"static TP1xDP2": [], "controller": [], "static TP2xDP1": []}
    tokens: dict[str, list] = {}
    events = []
    with Engine(model_path(), tp=1, dp=WORLD, dtype=DTYPE, profile_table=str(PROFILE),
                kv_cache_bytes=1 << 30) as engine:
        controller = engine.policy
        assert controller is not None, "the profile table did not attach a controller"
        for _ in range(args.repeats):
            for label in times:
                if label == "controller":
                    secs, toks, evs = timed(engine, prompts, params, controller, 1)
                    events.append(evs)
                else:
                    secs, toks, _ = timed(engine, prompts, params, StaticLayout(), 1 if "TP1" in label else 2)
                times[label].append(secs)
                tokens.setdefault(label, toks)
                assert toks == tokens[label], f"{label}: tokens changed between repeats"
    load_after = os.getloadavg()
    same = tokens["controller"] == tokens["static TP1xDP2"] == tokens["static TP2xDP1"]
    base = statistics.fmean(times["static TP1xDP2"])
    rows = [[label, " / ".join(f"{t:.2f}" for t in ts), f"{statistics.fmean(ts):.2f}",
             f"{statistics.fmean(ts) / base:.3f}"] for label, ts in times.items()]
    lines = []
    for i, evs in enumerate(events):
        for ev in evs:
            d = ev.decision
            lines.append(f"- run {i + 1}: t={ev.t:.1f}s {ev.from_layout} -> {ev.to_layout} ({ev.kv_path}, "
                         f"measured {ev.seconds * 1e3:.0f} ms) at stage step {d.get('stage_decode_step')}, "
                         f"{d.get('active')} active; predicted remaining "
                         f"{json.dumps(d.get('remaining_s'))} s, switch cost "
                         f"{json.dumps({k: round(v['total_s'], 4) for k, v in d.get('switch_cost_s', {}).items()})} s, "
                         f"gain {d.get('predicted_gain_s')} s")
    body = (f"Model bench/cpu_model.py ({DTYPE}, world {WORLD}); profile `{os.path.relpath(PROFILE)}`; "
            f"{args.requests} requests, response lengths {sorted(lengths, reverse=True)} (ignore_eos), "
            f"prompts 32-127 tokens. Runs alternate; {args.repeats} repeats each.\n"
            f"Load average before/after: {load_before[0]:.2f}/{load_after[0]:.2f} (2 cores, shared machine).\n\n"
            + markdown_table(["run", "generation seconds (each repeat)", "mean", "ratio to static TP1xDP2"], rows)
            + f"\n\nTokens identical across the controller and both static runs: **{same}**\n\n"
            + "Switches the controller made (the engine's SwitchEvent and its decision details):\n\n"
            + ("\n".join(lines) or "- none") + "\n")
    write_result("controller_e2e", "Controller end to end on CPU workers", body)
    if not same:
        raise SystemExit("tokens differ between the controller run and the static runs")


if __name__ == "__main__":
    main()
