"""The controller's host time between steps: decided at the step boundary, or while the next steps compute.

    PYTHONPATH=.:profiler python bench/controller_overlap.py [--rounds 4] [--requests 48]

On the fourth H100 run a co-located long tail took 1.76 s under the controller where static TP1xDP2 took
1.45 s, with the same layout throughout: every evaluation (a few ms of numpy) ran while the GPU waited
between steps.
On a GPU the controller now ``overlaps_steps``: it is asked right after the next steps are sent. This
bench puts the same situation on the CPU: a small model (steps of a few ms, as on a GPU) whose
``pat-profile`` table, measured here first, says stay at TP1xDP2. One engine runs the batch static, under
the controller deciding at the boundary (the CPU default) and under the controller overlapping
(``Switching.overlap_decisions``, the CUDA default, turned on), in an order rotated every round. On the
CPU the workers compute on the host's cores, so there is nothing to overlap with: the bench shows what
that costs there, and the GPU's side stays to be measured on a GPU. Reported: seconds per run (median over rounds), each mode
against static, the evaluations and their host time, the switches made, and whether the tokens equal the
static run's. A check that finds the controller's last clear stay standing (the same requests on the
same layout: ``ControllerConfig.recheck_clear_stay_steps``) is not priced again; the table counts those,
and a fourth mode prices every check (the controller before clear stays), at the boundary, beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from common import markdown_table, write_result
from pat_engine import Engine, SamplingParams
from pat_engine.predictor.policy import StaticLayout
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".pat-cache"
SPEC = TinyModelSpec(arch="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                     num_heads=4, num_kv_heads=2, max_position=1024, seed=11)
MODES = ("static TP1xDP2", "controller at the boundary", "controller overlapping",
         "controller at the boundary, every check priced")


def model_and_table() -> tuple[str, str]:
    """The model, and a pat-profile table of it at world 2 (TP 1 and 2), each written once."""
    model = CACHE / "overlap_llama_h128"
    if not (model / "model.safetensors").is_file():
        write_tiny_model(model, SPEC)
    table = CACHE / "overlap_llama_h128_w2_f32.json"
    if not table.is_file():
        argv = ["--model", str(model), "--world", "2", "--tp", "1", "2", "--dtype", "float32", "--device", "cpu",
                "--batch-sizes", "1", "4", "16", "32", "--context-lens", "64", "512", "--decode-window", "8",
                "--output", str(table)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        subprocess.run([sys.executable, "-m", "pat_profiler.cli", *argv], check=True, env=env, cwd=ROOT)
    return str(model), str(table)


def long_tail(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """64-token prompts; most responses 16-47 tokens, one in eight 480 (the tail)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(16, SPEC.vocab_size - 1, (n, 64)).tolist()
    return prompts, [480 if i % 8 == 7 else int(rng.integers(16, 48)) for i in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--seed", type=int, default=5)
    args = p.parse_args()
    model, table = model_and_table()
    prompts, lengths = long_tail(args.requests, args.seed)
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in lengths]
    times = {m: [] for m in MODES}
    host_s = {m: [] for m in MODES[1:]}
    evaluations = {m: 0 for m in MODES[1:]}
    unpriced = {m: 0 for m in MODES[1:]}  # checks that found the last clear stay unchanged
    switches = {m: 0 for m in MODES}
    same = {m: True for m in MODES[1:]}
    load = os.getloadavg()[0]
    with Engine(model, tp=1, dp=2, dtype="float32", profile_table=table, kv_cache_bytes=1 << 28) as engine:
        controller = engine.policy
        assert controller is not None, "the table did not attach a controller"
        base = controller.config
        decide = controller.decide
        spent: list[float] = []

        def timed_decide(status):
            t = time.perf_counter()
            try:
                return decide(status)
            finally:
                spent.append(time.perf_counter() - t)

        controller.decide = timed_decide
        reference = None
        for r in range(args.rounds):
            order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
            for mode in order:
                engine.reconfigure(1)
                before, seen, skipped = len(engine.switches), len(controller.history), controller.skipped
                spent.clear()
                if mode == MODES[0]:
                    engine.set_policy(StaticLayout())
                else:
                    engine.coordinator.switching.overlap_decisions = mode == MODES[2]  # the CUDA default
                    controller.config = replace(base, recheck_clear_stay_steps=0 if mode == MODES[3] else
                                                base.recheck_clear_stay_steps)
                    engine.set_policy(controller)
                t = time.perf_counter()
                outs = engine.generate(prompts, params, use_tqdm=False)
                times[mode].append(time.perf_counter() - t)
                switches[mode] += len(engine.switches) - before
                tokens = [o.token_ids for o in outs]
                if mode == MODES[0]:
                    reference = reference or tokens
                else:
                    evaluations[mode] += len(controller.history) - seen
                    unpriced[mode] += controller.skipped - skipped
                    host_s[mode].append(sum(spent))
                    same[mode] &= reference is None or tokens == reference
            print(f"round {r + 1}: " + ", ".join(f"{m} {times[m][-1]:.3f}s" for m in MODES), flush=True)
    median = {m: statistics.median(ts) for m, ts in times.items()}
    rows = [[m, " / ".join(f"{t:.3f}" for t in times[m]), median[m], median[m] / median[MODES[0]],
             evaluations.get(m, "-"), unpriced.get(m, "-"),
             f"{statistics.median(host_s[m]) * 1e3:.0f}" if m in host_s else "-",
             f"{sum(host_s[m]) / evaluations[m] * 1e3:.2f}" if m in host_s and evaluations[m] else "-", switches[m],
             "-" if m == MODES[0] else ("yes" if same[m] and reference is not None else "no")]
            for m in MODES]
    body = "\n".join([
        f"1-minute load at the start: {load:.2f}.",
        "",
        f"Model: llama, hidden {SPEC.hidden_size}, {SPEC.num_layers} layers, vocab {SPEC.vocab_size}, float32, "
        f"TP1xDP2 (two worker processes), its pat-profile table measured on this machine. Batch: "
        f"{len(prompts)} requests of 64 prompt tokens, {lengths.count(480)} of them 480 new tokens, the rest "
        f"16-47 (greedy, ignore_eos). One engine, the modes in an order rotated every round; seconds from "
        f"submitting the batch to its last token. *evaluations*: the controller's, summed over rounds; *checks "
        f"not priced*: checks that found the last clear stay standing (the same requests on the same layout, "
        f"`ControllerConfig.recheck_clear_stay_steps`); *host ms a run*: the controller's time in one run, every "
        f"check (median over rounds); *ms an evaluation*: that time over the evaluations.",
        "",
        markdown_table(["mode", "seconds per round", "median s", "vs static", "evaluations", "checks not priced",
                        "host ms a run",
                        "ms an evaluation", "switches", "tokens = static"], rows),
        "",
        f"Overlapping against the boundary: **{median[MODES[1]] / median[MODES[2]]:.3f}x**; clear stays left "
        f"unpriced against every check priced (both at the boundary): **{median[MODES[3]] / median[MODES[1]]:.3f}x** "
        "(median times).",
    ])
    write_result("controller_overlap", "The controller's host time: at the step boundary or overlapping the "
                 "next steps (CPU)", body)


if __name__ == "__main__":
    main()
