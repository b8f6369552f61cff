"""Does cost-aware DP placement earn its place? One rollout round where it should matter (SIMULATED).

    PYTHONPATH=.:profiler python bench/placement_gain.py [--tables a40 h100] [--trials 8]

Workload: skewed prompt lengths (a quarter of the prompts long-context), n samples per prompt
whose lengths persist per prompt (the predicted length of a request is the mean of the same
prompt's n lengths one step earlier, what ``LengthHistory`` holds after a step), the PAT switch
controller running inside the round (so switches happen and rebalance the unfinished requests).
Each trial replays the same batch under three arms, on the discrete-event simulator and a
latency table (bench/longtail: every constant stated there; none of this is a measurement):

- default: the coordinator's routing (fewest outstanding tokens) at admission, a switch
  re-places by context (``balance_by_context``), the controller prices that;
- LPT admission only: ``place_lpt`` on predicted cost at admission, switches as default;
- cost-aware: LPT admission, and every switch re-places with ``AdmissionPlacement.rebalance``
  (``switch_placement`` with the rule installed), the controller pricing that same placement
  (``ClusterStatus.placement``), as the engine does with the hook installed.

Writes bench/results/placement_gain.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from common import markdown_table, write_result
from longtail.multistep import RoundSimulation, throughput_tp
from longtail.policies import distribution_policy
from longtail.simulator import Group, SwitchRecord
from longtail.tables import a40_table, h100_table
from longtail.workload import Batch, LongTail
from pat_engine.parallel.dp_placement import switch_placement
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.policy import ClusterStatus, GroupSnapshot, RequestSnapshot
from pat_engine.predictor.predictor import LatencyPredictor
from pat_engine.rollout.placement import AdmissionPlacement, PlacementItem, PredictorCost, default_token_cap, place_lpt

TABLES = {
    "a40": (a40_table, 16384, "8xA40 paper-calibrated (Llama-3.1-8B, TP 2/4/8), cap 16K"),
    "h100": (lambda: h100_table(True), 24576, "8xH100 analytic + per-replica batch overheads (TP 1/2/4/8), cap 24K"),
}


class PlacedSimulation(RoundSimulation):
    """The simulator with an installed placement rule: snapshots carry request ids, a switch re-places
    with ``switch_placement(rule, ...)`` and the controller sees the rule in ``ClusterStatus``."""

    def __init__(self, *args, rule: AdmissionPlacement | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.rule = rule

    def _snap(self, i: int, generated: int, cached: bool) -> RequestSnapshot:
        return RequestSnapshot(int(self.prompt[i]), generated, self.cap, cached, f"r{i}", i)

    def status(self) -> ClusterStatus:
        groups = []
        for gi, g in enumerate(self.groups):
            reqs = [self._snap(i, self._tokens(g, i), True) for i in g.running]
            reqs += [self._snap(i, int(self.generated[i]), bool(self.cached[i])) for i in g.waiting]
            groups.append(GroupSnapshot(gi, tuple(reqs), 0, 0, None))
        return ClusterStatus(self.now, self.layout, tuple(groups), self.stage_step, 16, self.rule)

    def _switch(self, tp: int) -> None:  # the simulator's switch, placing with the rule
        old, new = self.layout, Layout.for_world(self.layout.world, tp)
        order: list[int] = []
        for g in self.groups:
            for i in g.running:
                self.generated[i] = self._tokens(g, i)
            order += list(g.running) + list(g.waiting)
        status = self.status()
        reqs = status.requests
        placement = self.pred.current_placement([len(g.requests) for g in status.groups])
        target = switch_placement(self.rule, reqs, new.dp)
        cost = self.pred.switch_cost(old, new, reqs, placement, target)
        migrate = cost.kv_path == "migrate"
        seconds = cost.weights_s + cost.fixed_s + (cost.migrate_s if migrate else 0.0)
        self.switches.append(SwitchRecord(self.now, old.tp, tp, len(reqs), seconds, cost.kv_path,
                                          self._pending_details))
        self.now += seconds
        self.layout = new
        self.groups = [Group(steps=self.stage_step) for _ in range(new.dp)]
        for gi, idx in enumerate(target):
            for k in sorted(idx, key=lambda k: order[k]):
                i = order[k]
                if migrate and self.cached[i]:
                    self._join(self.groups[gi], i)
                else:
                    self.cached[i] = False
                    self.groups[gi].waiting.append(i)
        self.pending = None
        self.timeline.append((self.now, self.active, tp))


def make_trial(dist: LongTail, cap: int, prompts: int, n: int, long_share: float, seed: int):
    """Prompt lengths, this step's response lengths, last step's (the history) and the predicted lengths."""
    rng = np.random.default_rng(seed)
    long = rng.random(prompts) < long_share
    plen = np.where(long, rng.integers(2000, 6001, prompts), rng.integers(100, 401, prompts))
    zp = rng.standard_normal(prompts)

    def draw() -> np.ndarray:
        z = math.sqrt(dist.prompt_corr) * np.repeat(zp, n) + math.sqrt(1 - dist.prompt_corr) * rng.standard_normal(
            prompts * n)
        return np.clip(np.round(np.exp(dist.mu + dist.sigma * z) * dist.scale), 1, cap).astype(np.int64)

    before, now = draw(), draw()
    predicted = np.repeat(before.reshape(prompts, n).mean(axis=1), n)
    return np.repeat(plen, n), now, before, predicted


def run_arm(arm: str, pred: LatencyPredictor, world: int, cap: int, plens, lens, history, predicted, args) -> tuple:
    tp = throughput_tp(pred, len(lens), float(np.mean(plens)), world)
    dp = world // tp
    placement = order = rule = None
    if arm != "default":
        cost = PredictorCost(pred, tp, max(len(lens) // dp, 1))
        items = [PlacementItem(cost(int(p), float(min(r, cap))), int(p + min(r, cap)), unit=i // args.n)
                 for i, (p, r) in enumerate(zip(plens, predicted))]
        placement = place_lpt(items, dp, default_token_cap(items, dp))
        order = sorted(range(len(items)), key=lambda i: -items[i].cost)
        if arm == "cost-aware":
            rule = AdmissionPlacement(cost)
            for i, r in enumerate(predicted):
                rule.expect(f"r{i}", float(min(r, cap)), unit=i // args.n)
    policy = distribution_policy(pred, args.check_interval, [history], cap, draws=args.draws, seed=0)
    sim = PlacedSimulation(pred, Batch(plens, lens, cap), tp, world, args.max_num_seqs, args.check_interval, policy,
                           placement=placement, order=order, rule=rule)
    return sim.run_round(), len(sim.switches), tp


ARMS = ("default", "LPT admission only", "cost-aware")


def run_table(name: str, args) -> str:
    make, cap, desc = TABLES[name]
    table = make()
    pred = LatencyPredictor(table, max_num_seqs=args.max_num_seqs)
    world = table.deployment.world
    dist = LongTail.fit(prompt_corr=args.prompt_corr)
    rows, totals, wins = [], {a: [] for a in ARMS}, 0
    for trial in range(args.trials):
        plens, lens, history, predicted = make_trial(dist, cap, args.prompts, args.n, args.long_share,
                                                     args.seed + trial)
        t = time.perf_counter()
        got = {a: run_arm(a, pred, world, cap, plens, lens, history, predicted, args) for a in ARMS}
        for a in ARMS:
            totals[a].append(got[a][0])
        wins += got["cost-aware"][0] < got["default"][0]
        rows.append([trial, f"TP{got['default'][2]}"] + [f"{got[a][0]:.1f} ({got[a][1]} sw)" for a in ARMS]
                    + [f"{got['default'][0] / got['cost-aware'][0]:.3f}x"])
        print(f"  {name} trial {trial}: " + ", ".join(f"{a} {got[a][0]:.1f} s" for a in ARMS)
              + f" ({time.perf_counter() - t:.0f} s wall)", flush=True)
    ratio = [d / c for d, c in zip(totals["default"], totals["cost-aware"])]
    summary = markdown_table(["arm", "round s, sum of trials", "vs default", "mean per-trial speed-up"],
                             [[a, sum(totals[a]), f"{sum(totals['default']) / sum(totals[a]):.3f}x",
                               f"{statistics.fmean(d / x for d, x in zip(totals['default'], totals[a])):.3f}x"]
                              for a in ARMS])
    per_trial = markdown_table(["trial", "start TP"] + [f"{a} s (switches)" for a in ARMS] + ["default / cost-aware"],
                               rows)
    return (f"### {name}: {desc}\n\n- workload per trial: {args.prompts} prompts x {args.n} samples, "
            f"{100 * args.long_share:.0f}% of prompts 2000-6000 tokens, the rest 100-400; response lengths "
            f"{dist.describe()}; predicted length = the prompt's mean over its {args.n} lengths one step earlier; "
            f"PAT controller every {args.check_interval} decode steps, {args.draws} length draws\n"
            f"- cost-aware faster than default in {wins}/{args.trials} trials; per-trial ratio min "
            f"{min(ratio):.3f}x, max {max(ratio):.3f}x\n\n" + summary + "\n\n" + per_trial + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tables", nargs="+", default=["a40", "h100"], choices=sorted(TABLES))
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--long-share", type=float, default=0.25, help="share of long-context prompts")
    p.add_argument("--prompt-corr", type=float, default=0.6)
    p.add_argument("--check-interval", type=int, default=512)
    p.add_argument("--draws", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    sections = [run_table(name, args) for name in args.tables]
    write_result("placement_gain", "Cost-aware DP placement on a skewed round (SIMULATED)",
                 "Simulated rollout seconds of one round from latency tables, not measurements. "
                 "Arms (bench/placement_gain.py): default = the coordinator's routing and context rebalancing; "
                 "LPT admission only; cost-aware = LPT admission + the rule's rebalance on every switch, "
                 "priced by the controller with the same rule.\n\n" + "\n".join(sections))


if __name__ == "__main__":
    main()
