"""When the profile table is off: the controller with the table alone vs corrected by the steps it sees.

    PYTHONPATH=.:profiler python bench/simulate_calibration.py [--stages 3] [--check-interval 32]

Every figure is SIMULATED (bench/longtail/simulator.py on the paper-calibrated 8xA40 table,
bench/longtail/tables.py); none is a measurement. The simulator's table is the truth; the controller
prices with a *profiled* table that differs from it by a stated factor per TP degree (what a table
measured on another day, or with every DP group in step, can miss). Per scenario, the same stages
(RL steps: one batch each, the lengths of the stage before known to the length estimator) run under
  - the best static layout (the truth's),
  - the controller pricing with the profiled table alone (``calibrate_profile=False``),
  - the controller pricing with the profiled table corrected by the decode steps it has seen
    (pat_engine/predictor/step_calibration.py; one predictor across the stages, as in an engine),
  - the controller pricing with the truth (what a right table would give).
Writes bench/results/simulate_calibration.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np

from common import markdown_table, write_result
from longtail.policies import distribution_policy
from longtail.simulator import Simulation
from longtail.tables import a40_table
from longtail.workload import LongTail, make_batch
from pat_engine.predictor.predictor import LatencyPredictor
from pat_engine.predictor.step_calibration import CalibrationConfig
from pat_engine.predictor.table import ProfileTable

PROMPTS, PER_PROMPT, CAP, PROMPT_RANGE, MAX_SEQS = 128, 8, 16384, (100, 400), 1024  # simulate_long_tail.py's "a40"

# truth / profiled decode step, per TP degree (1: the table is right there)
SCENARIOS = {
    "the table is right": {},
    "the machine is 1.3x slower than when profiled": {2: 1.3, 4: 1.3, 8: 1.3},
    "TP8 runs 1.3x slower than its profile": {8: 1.3},
    "TP8 runs 1.3x faster than its profile": {8: 1 / 1.3},
    "the base layout (TP2) runs 1.3x slower than its profile": {2: 1.3},
}


def profiled(truth: ProfileTable, off: dict[int, float]) -> ProfileTable:
    """The table a controller would hold: each TP degree's decode steps divided by ``off``."""
    points = [dataclasses.replace(p, decode_step_s=p.decode_step_s / off.get(p.tp, 1.0)) for p in truth.points]
    return dataclasses.replace(truth, points=points)


def run_stages(truth: LatencyPredictor, batches: list, k: int, start_tp: int,
               pred: LatencyPredictor | None) -> tuple[float, int]:
    """Simulated seconds and switches of every stage in turn; ``pred`` None: static at ``start_tp``."""
    total, switches = 0.0, 0
    world = truth.table.deployment.world
    for i, batch in enumerate(batches):
        policy = observer = None
        if pred is not None:
            history = [batches[i - 1].lengths] if i else []
            policy = distribution_policy(pred, k, history, CAP, seed=i)
            observer = pred.record_decode_step if pred.calibration is not None else None
        sim = Simulation(truth, batch, start_tp, world, MAX_SEQS, k, policy, observer)
        sim.run()
        total += sim.finished_at
        switches += len(sim.switches)
    return total, switches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--check-interval", type=int, default=32)
    args = p.parse_args()
    started = time.perf_counter()
    truth_table = a40_table()
    truth = LatencyPredictor(truth_table, max_num_seqs=MAX_SEQS, calibration=None)
    dist = LongTail.fit()
    batches = [make_batch(dist, np.random.default_rng(seed), PROMPTS, PER_PROMPT, CAP, PROMPT_RANGE)
               for seed in range(args.stages)]
    start_tp = min(truth.tps)  # the throughput layout: the best static one for a whole batch on this table
    statics = {tp: run_stages(truth, batches, args.check_interval, tp, None)[0] for tp in truth.tps}
    best_tp = min(statics, key=statics.get)
    # the controller pricing with the truth: the same in every scenario (and the table alone where it is right)
    right = run_stages(truth, batches, args.check_interval, start_tp,
                       LatencyPredictor(truth_table, max_num_seqs=MAX_SEQS, calibration=None))
    rows = []
    for name, off in SCENARIOS.items():
        table = profiled(truth_table, off)
        alone = right if not off else run_stages(truth, batches, args.check_interval, start_tp,
                                                 LatencyPredictor(table, max_num_seqs=MAX_SEQS, calibration=None))
        calibrated = run_stages(truth, batches, args.check_interval, start_tp,
                                LatencyPredictor(table, max_num_seqs=MAX_SEQS, calibration=CalibrationConfig()))
        result = {"table alone": alone, "calibrated": calibrated, "the truth": right}
        rows.append([name, ", ".join(f"TP{tp} x{f:.2f}" for tp, f in sorted(off.items())) or "-"]
                    + [f"{statics[best_tp] / s:.3f}x ({n})" for s, n in result.values()])
        print(f"{name}: " + ", ".join(f"{label} {s:.0f} s" for label, (s, _) in result.items()), flush=True)
    statics_text = ", ".join(f"TP{tp} {s:.0f} s" for tp, s in sorted(statics.items()))
    body = (
        "All times are SIMULATED from the paper-calibrated 8xA40 table (bench/longtail/tables.py), not measured.\n\n"
        f"Workload: {args.stages} stages (RL steps), each {PROMPTS} prompts x {PER_PROMPT} samples, cap {CAP}, "
        f"prompts {PROMPT_RANGE[0]}-{PROMPT_RANGE[1]} tokens, lengths {dist.describe()}; the controller starts "
        f"each stage at TP{start_tp}, checks every {args.check_interval} decode steps and knows the lengths of "
        f"the stage before. Static layouts over all stages (the truth): {statics_text}; the best, TP{best_tp}, "
        "is the baseline.\n\n"
        "The profiled table is the truth with each listed TP degree's decode steps divided by its factor (truth = "
        "profiled x factor). Cells: speed-up over the best static layout (switches over all stages in "
        "brackets).\n\n"
        + markdown_table(["scenario", "truth / profiled", "controller, table alone", "controller, calibrated",
                          "controller, the true table"], rows)
        + f"\n\nWall time {time.perf_counter() - started:.0f} s.\n")
    write_result("simulate_calibration", "When the profile is off: the controller with and without step calibration",
                 body)


if __name__ == "__main__":
    main()
