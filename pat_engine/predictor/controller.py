"""The switch controller: the paper's Algorithm 1 as a ``SwitchPolicy``.

At every evaluation (every ``switch_check_interval`` decode steps, from the
coordinator's merged status): predict the remaining decode time under the
current layout; for every other candidate TP, the remaining time after
redistributing the unfinished requests over its DP groups plus the one-time
switch cost; pick the cheapest; switch only when it beats staying. The
controller is asked again later, so several switches per stage happen
naturally (TP rising as the batch shrinks).

Hysteresis: the predicted gain must exceed ``min_gain_frac`` of the time
left under the current layout (default 2%). Switching on a predicted gain
smaller than the predictor's own error (a few % MAPE, see
bench/results/predictor_accuracy.md) is a coin flip that pays a certain cost;
the margin also stops A->B->A flapping when two layouts are nearly equal.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pat_engine.core.policy import ClusterStatus, SwitchDecision
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.lengths import RemainingEstimator, SnapshotLengthTracker
from pat_engine.predictor.predictor import LatencyPredictor, balance

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControllerConfig:
    candidate_tps: tuple[int, ...] | None = None  # default: every tp the table profiled
    min_gain_frac: float = 0.02  # hysteresis, see the module docstring
    min_gain_s: float = 0.0
    seed: int = 0  # for the length draws
    check_interval: int = 8  # the engine's switch_check_interval (length inference needs it)


@dataclass
class Evaluation:
    """One run of Algorithm 1, kept for timelines and benchmarks."""

    stage_step: int
    active: int
    current_tp: int
    remaining_s: dict[int, float]  # tp -> predicted remaining decode time (no switch cost)
    switch_cost_s: dict[int, dict]  # tp -> cost breakdown
    chosen_tp: int
    details: dict = field(default_factory=dict)


class SwitchController:
    def __init__(self, predictor: LatencyPredictor, estimator: RemainingEstimator,
                 config: ControllerConfig = ControllerConfig(),
                 can_hold: Callable[[Layout, ClusterStatus], bool] | None = None,
                 tracker: SnapshotLengthTracker | None = None):
        self.predictor = predictor
        self.estimator = estimator
        self.config = config
        self.can_hold = can_hold  # KV capacity check of a target layout (the coordinator refuses otherwise)
        self.tracker = tracker
        self.rng = np.random.default_rng(config.seed)
        tps = config.candidate_tps or tuple(predictor.tps)
        self.candidates = tuple(tp for tp in tps if tp in predictor.tps)
        self.history: list[Evaluation] = []

    def decide(self, status: ClusterStatus) -> SwitchDecision | None:
        reqs = status.requests
        if self.tracker is not None:
            self.tracker.update(reqs, status.stage_decode_step)
        if not reqs:
            return None
        cur = status.layout
        rem = self.estimator.draws(reqs, self.rng)  # (draws, n), shared by every candidate
        placement = self.predictor.current_placement([len(g.requests) for g in status.groups])
        remaining = {cur.tp: float(self.predictor.remaining_seconds(cur, reqs, placement, rem).mean())}
        costs: dict[int, dict] = {}
        totals = {cur.tp: remaining[cur.tp]}
        contexts = [r.context_len for r in reqs]
        for tp in self.candidates:
            if tp == cur.tp:
                continue
            new = Layout.for_world(cur.world, tp)
            if self.can_hold is not None and not self.can_hold(new, status):
                continue
            target = balance(contexts, new.dp)
            remaining[tp] = float(self.predictor.remaining_seconds(new, reqs, target, rem).mean())
            cost = self.predictor.switch_cost(cur, new, reqs, placement, target)
            costs[tp] = cost.to_dict()
            totals[tp] = remaining[tp] + cost.total_s
        best = min(totals, key=lambda tp: (totals[tp], tp != cur.tp))
        gain = totals[cur.tp] - totals[best]
        margin = max(self.config.min_gain_frac * totals[cur.tp], self.config.min_gain_s)
        chosen = best if best != cur.tp and gain > margin else cur.tp
        details = {
            "estimator": self.estimator.name,
            "stage_decode_step": status.stage_decode_step,
            "active": len(reqs),
            "current": str(cur),
            "remaining_s": {str(tp): round(t, 6) for tp, t in sorted(remaining.items())},
            "switch_cost_s": {str(tp): {k: (round(v, 6) if isinstance(v, float) else v) for k, v in c.items()}
                              for tp, c in sorted(costs.items())},
            "stay_s": round(totals[cur.tp], 6),
            "best_total_s": round(totals[best], 6),
            "predicted_gain_s": round(gain, 6),
            "margin_s": round(margin, 6),
        }
        self.history.append(Evaluation(status.stage_decode_step, len(reqs), cur.tp, remaining, costs, chosen, details))
        if chosen == cur.tp:
            return None
        reason = (f"{self.estimator.name}: remaining {totals[cur.tp]:.3f}s at {cur} > "
                  f"{remaining[chosen]:.3f}s + switch {costs[chosen]['total_s']:.3f}s at TP{chosen}")
        # kv_path None: the coordinator picks migrate/recompute from the exact move plan, with our rates
        return SwitchDecision(chosen, reason, None, details)
