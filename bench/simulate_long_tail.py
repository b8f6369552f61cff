"""Replay long-tail rollout batches on profiled deployments: static vs the paper's policy vs ours vs an oracle.

    PYTHONPATH=.:profiler python bench/simulate_long_tail.py [--deployments cpu a40 h100-roofline h100-batch]
        [--seeds 0 1 2] [--check-interval 16]

For each deployment and seed: one batch of prompts x samples with lengths
from the stated long-tail distribution (bench/longtail/workload.py), replayed
by the discrete-event simulator (bench/longtail/simulator.py) under
  - every static layout (the best one is the baseline),
  - Algorithm 1 with the paper's max-length bound (current layout priced with
    its requests re-spread like a candidate's; ablation: as placed),
  - our controller: lengths drawn from the learned distribution plus the
    lookahead, warm (one earlier stage of the same distribution seen) and cold
    (first stage: the tail falls back to the bound),
  - the hindsight oracle (bench/longtail/oracle.py).
Adaptive runs start at the layout with the lowest step latency for the full
batch. Writes bench/results/simulate_long_tail.md and one PNG per deployment.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common import RESULTS, markdown_table, write_result
from cpu_model import PROFILE as CPU_PROFILE
from longtail.oracle import search
from longtail.plot import plot_runs
from longtail.policies import distribution_policy, paper_policy
from longtail.simulator import Simulation
from longtail.tables import a40_table, h100_table
from longtail.workload import LongTail, make_batch
from pat_engine.predictor.predictor import LatencyPredictor
from pat_engine.predictor.table import ProfileTable


@dataclass(frozen=True)
class Scenario:
    prompts: int
    per_prompt: int
    cap: int
    prompt_range: tuple[int, int]
    scale: float = 1.0  # of the length distribution
    max_num_seqs: int = 1024

    def describe(self) -> str:
        return (f"{self.prompts} prompts x {self.per_prompt} samples, cap {self.cap}, prompts "
                f"{self.prompt_range[0]}-{self.prompt_range[1]} tokens, max {self.max_num_seqs} running per group")


def deployments(cpu_profile: Path) -> dict:
    return {
        "cpu": (lambda: ProfileTable.load(cpu_profile),
                Scenario(4, 8, 192, (32, 64), scale=192 / 16384, max_num_seqs=256),
                "measured here with pat-profile (2 CPU worker processes, bench/cpu_model.py)"),
        "a40-128": (a40_table, Scenario(16, 8, 16384, (100, 400)),
                    "8xA40 paper-calibrated, 128 responses (the paper's batch)"),
        "a40": (a40_table, Scenario(128, 8, 16384, (100, 400)), "8xA40 paper-calibrated, 128 prompts x 8"),
        "h100-roofline": (lambda: h100_table(False), Scenario(128, 8, 24576, (100, 400)),
                          "8xH100 analytic, roofline + NCCL only"),
        "h100-batch": (lambda: h100_table(True), Scenario(128, 8, 24576, (100, 400)),
                       "8xH100 analytic + per-replica batch overheads"),
    }


def base_layout(pred: LatencyPredictor, n: int, context: float, world: int) -> int:
    """Throughput-oriented start: the TP with the lowest step latency for the whole batch."""
    def step(tp: int) -> float:
        b = -(-n // (world // tp))
        return pred.decode.scalar(tp, b, b * context)

    return min(pred.tps, key=lambda tp: (step(tp), tp))


def run_seed(table: ProfileTable, sc: Scenario, seed: int, k: int) -> tuple[dict, dict]:
    dist = LongTail.fit(scale=sc.scale)
    rng = np.random.default_rng(seed)
    batch = make_batch(dist, rng, sc.prompts, sc.per_prompt, sc.cap, sc.prompt_range)
    earlier = make_batch(dist, np.random.default_rng(10_000 + seed), sc.prompts, sc.per_prompt, sc.cap, sc.prompt_range)
    pred = LatencyPredictor(table, max_num_seqs=sc.max_num_seqs)
    world = table.deployment.world
    base = base_layout(pred, len(batch.lengths), float(np.mean(batch.prompt_lens)), world)

    def make(tp: int, policy=None) -> Simulation:
        return Simulation(pred, batch, tp, world, sc.max_num_seqs, k, policy)

    oracle = search(make, base, pred.tps)
    best_static_tp = min(oracle.static, key=oracle.static.get)
    runs = {}
    static_sim = make(best_static_tp)
    static_sim.run()
    runs[f"best static (TP{best_static_tp})"] = static_sim
    for label, policy in (
        ("paper (max-length bound)", paper_policy(pred, k)),
        ("paper, current groups as placed", paper_policy(pred, k, "actual")),
        ("ours (length distribution)", distribution_policy(pred, k, [earlier.lengths], sc.cap, seed=seed)),
        ("ours, cold start", distribution_policy(pred, k, [], sc.cap, seed=seed)),
    ):
        sim = make(base, policy)
        sim.run()
        runs[label] = sim
    runs["oracle"] = oracle.sim
    info = {"base": base, "best_static_tp": best_static_tp, "static": oracle.static,
            "oracle_start": oracle.start_tp, "oracle_schedule": oracle.schedule, "n": len(batch.lengths), "max_len": int(batch.lengths.max()),
            "capped": int((batch.lengths >= sc.cap).sum())}
    return runs, info


def summarize(name: str, desc: str, table: ProfileTable, sc: Scenario, seeds: list[int], k: int) -> tuple[str, dict]:
    per_seed, plots = [], None
    for seed in seeds:
        t = time.perf_counter()
        runs, info = run_seed(table, sc, seed, k)
        per_seed.append((runs, info))
        plots = plots or runs
        print(f"  {name} seed {seed}: {time.perf_counter() - t:.1f}s", flush=True)
    labels = list(per_seed[0][0])
    rows = []
    for label in labels:
        times = [runs[label].finished_at for runs, _ in per_seed]
        red = [1 - runs[label].finished_at / runs[labels[0]].finished_at for runs, _ in per_seed]
        gap = [runs[label].finished_at / runs["oracle"].finished_at - 1 for runs, _ in per_seed]
        sw = [len(runs[label].switches) for runs, _ in per_seed]
        rows.append([label, statistics.fmean(times), f"{100 * statistics.fmean(red):+.1f}%",
                     f"{100 * statistics.fmean(gap):+.1f}% (max {100 * max(gap):+.1f}%)", statistics.fmean(sw)])
    png = RESULTS / f"long_tail_{name}.png"
    plot_runs(plots, f"{name}: {desc} (seed {seeds[0]})", png)
    detail = []
    for seed, (runs, info) in zip(seeds, per_seed):
        statics = ", ".join(f"TP{tp} {s:.1f}" for tp, s in sorted(info["static"].items()))
        sw = "; ".join(f"{lbl}: " + (", ".join(f"TP{x.from_tp}->TP{x.to_tp}@{x.t:.0f}s({x.active} left)"
                                                             for x in runs[lbl].switches) or "none")
                       for lbl in labels[1:])
        detail.append(f"- seed {seed}: {info['n']} requests, longest {info['max_len']}, {info['capped']} at the cap; "
                      f"start TP{info['base']}; static {statics}; switches: {sw}")
    text = (f"### {name}: {desc}\n\n- table: {table.meta.get('source', table.deployment.device)}\n"
            f"- workload: {sc.describe()}; lengths {LongTail.fit(scale=sc.scale).describe()}\n"
            f"- seeds {seeds}; policy checks every {k} decode steps\n\n"
            + markdown_table(["policy", "generation time (s, mean)", "reduction vs best static",
                              "gap to oracle", "switches (mean)"], rows)
            + "\n\n" + "\n".join(detail) + f"\n\n![{name}]({png.name})\n")
    return text, {r[0]: r for r in rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deployments", nargs="+", default=["cpu", "a40-128", "a40", "h100-roofline", "h100-batch"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--check-interval", type=int, default=32)
    p.add_argument("--cpu-profile", type=Path, default=CPU_PROFILE)
    args = p.parse_args()
    known = deployments(args.cpu_profile)
    sections = []
    for name in args.deployments:
        make_table, sc, desc = known[name]
        print(f"{name}: {desc}", flush=True)
        text, _ = summarize(name, desc, make_table(), sc, args.seeds, args.check_interval)
        sections.append(text)
    write_result("simulate_long_tail", "Long-tail rollout replay: static vs adaptive TP vs oracle",
                 "Reduction = 1 - time / best static time (positive is faster); gap = time / oracle time - 1.\n"
                 "Times come from the simulator driven by each table; they are not measurements of a run.\n\n"
                 + "\n".join(sections))


if __name__ == "__main__":
    main()
