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

Lookahead (ours, on by default; ``lookahead=False`` is the paper's rule):
before switching now, price switching later instead (``lookahead.py``); if
"stay s more steps, then switch" is predicted faster than switching now, wait
and ask again at the next check.

Clear stays (ours): an evaluation costs milliseconds of host time. When one
finds every switch far worse than staying (each plan at least
``clear_stay_frac`` over), the same requests on the same layout are not priced
again until one finishes or arrives, or ``recheck_clear_stay_steps`` pass: a
switch starts to pay as the batch shrinks, and between finishes the prices
only drift (contexts grow, survivors' expected lengths move).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pat_engine.predictor.policy import ClusterStatus, SpeculationStatus, SwitchDecision
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.lengths import RemainingEstimator, SnapshotLengthTracker
from pat_engine.predictor.lookahead import Future, deferral_steps, deferred, drain_groups, switch_value
from pat_engine.parallel.dp_placement import Placement, switch_placement
from pat_engine.predictor.predictor import LatencyPredictor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControllerConfig:
    candidate_tps: tuple[int, ...] | None = None  # default: every tp the table profiled
    min_gain_frac: float = 0.02  # hysteresis, see the module docstring
    min_gain_s: float = 0.0
    seed: int = 0  # for the length draws
    check_interval: int = 8  # the engine's switch_check_interval (length inference needs it)
    lookahead: bool = True  # also price deferred switches (see the module docstring)
    lookahead_draws: int = 16  # of the estimator's draws, used by the (costlier) lookahead
    # how the current layout's remaining time is estimated: "actual" = its groups as they are now;
    # "balanced" = its requests re-spread like a candidate's (like for like: no credit for rebalancing)
    current_placement: str = "balanced"
    # a stay this clear (every switch plan >= (1 + frac) x staying) is not re-priced while the same requests
    # run on the same layout, for up to this many decode steps (0: price every check); see the docstring
    clear_stay_frac: float = 0.25
    recheck_clear_stay_steps: int = 64


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
    targets: dict[int, Placement] = field(default_factory=dict)  # tp -> the placement priced (indices into requests)


@dataclass(frozen=True)
class ClearStay:
    """What a clear stay was found for: re-priced when any of it changes (or its steps run out)."""

    stage_step: int
    layout: Layout
    requests: tuple  # (seq_id, request_id, prompt_len, max_new_tokens) of each unfinished request, sorted
    speculation: SpeculationStatus | None

    @staticmethod
    def key(status: ClusterStatus) -> tuple:
        return tuple(sorted((r.seq_id, r.request_id, r.prompt_len, r.max_new_tokens) for r in status.requests))


class SwitchController:
    # on a GPU, decide after the next steps are sent: its numpy over (draws x requests) for every candidate
    # takes milliseconds, which the GPU spent idle between steps (the fourth H100 run: 1.76 s against static
    # TP1xDP2's 1.45 s with the same choices, bench/results/gpu_check.md, part controller)
    overlaps_steps = True

    def __init__(self, predictor: LatencyPredictor, estimator: RemainingEstimator,
                 config: ControllerConfig = ControllerConfig(),
                 can_hold: Callable[[Layout, ClusterStatus], bool] | None = None,
                 tracker: SnapshotLengthTracker | None = None):
        self.predictor = predictor
        self.estimator = estimator
        self.config = config
        self.can_hold = can_hold  # KV capacity check of a target layout (the coordinator refuses otherwise)
        self.tracker = tracker
        tps = config.candidate_tps or tuple(predictor.tps)
        self.candidates = tuple(tp for tp in tps if tp in predictor.tps)
        self.history: list[Evaluation] = []
        self.clear_stay: ClearStay | None = None
        self.skipped = 0  # checks that found the last clear stay unchanged

    def decide(self, status: ClusterStatus) -> SwitchDecision | None:
        reqs = status.requests
        if self.tracker is not None:
            self.tracker.update(reqs, status.stage_decode_step)
        if not reqs:
            return None
        if self._still_clear(status):
            self.skipped += 1
            return None
        cur = status.layout
        self.predictor.set_speculation(status.speculation)  # the tail's steps at speculation's measured speed
        # (draws, n), shared by every candidate; the same seed at every check, so consecutive checks
        # see mostly the same futures and do not flip on sampling noise alone
        rem = self.estimator.draws(reqs, np.random.default_rng(self.config.seed))
        placement = self.predictor.current_placement([len(g.requests) for g in status.groups])
        contexts = [r.context_len for r in reqs]
        # placed as the switch would place them: its rule (the installed placement's rebalance, if any)
        as_is = (placement if self.config.current_placement == "actual"
                 else switch_placement(status.placement, reqs, cur.dp))
        remaining = {cur.tp: float(self.predictor.remaining_seconds(cur, reqs, as_is, rem).mean())}
        costs: dict[int, dict] = {}
        targets: dict[int, Placement] = {}
        totals = {cur.tp: remaining[cur.tp]}
        for tp in self.candidates:
            if tp == cur.tp:
                continue
            new = Layout.for_world(cur.world, tp)
            if self.can_hold is not None and not self.can_hold(new, status):
                continue
            target = targets[tp] = switch_placement(status.placement, reqs, new.dp)
            remaining[tp] = float(self.predictor.remaining_seconds(new, reqs, target, rem).mean())
            cost = self.predictor.switch_cost(cur, new, reqs, placement, target)
            costs[tp] = cost.to_dict()
            totals[tp] = remaining[tp] + cost.total_s
        plans = dict(totals)  # tp -> predicted total when switching there now (cur: staying)
        later: dict[str, float] = {}
        now: dict[int, float] = {}
        wait: dict[int, float] = {}
        if self.config.lookahead and costs:
            plans, later, now, wait = self._look_ahead(cur, reqs, as_is, rem, totals, costs, contexts)
        stay = min([totals[cur.tp], *later.values()])  # stay for good, or stay now and switch later
        best = min((tp for tp in plans if tp != cur.tp), key=plans.get, default=cur.tp)
        gain = totals[cur.tp] - plans.get(best, totals[cur.tp])
        margin = max(self.config.min_gain_frac * totals[cur.tp], self.config.min_gain_s)
        sooner = best not in wait or now[best] <= wait[best]  # the same switch later is not better
        chosen = best if best != cur.tp and gain > margin and plans[best] < stay and sooner else cur.tp
        details = {
            "estimator": self.estimator.name,
            "stage_decode_step": status.stage_decode_step,
            "active": len(reqs),
            "current": str(cur),
            "remaining_s": {str(tp): round(t, 6) for tp, t in sorted(remaining.items())},
            "switch_cost_s": {str(tp): {k: (round(v, 6) if isinstance(v, float) else v) for k, v in c.items()}
                              for tp, c in sorted(costs.items())},
            "stay_s": round(totals[cur.tp], 6),
            "plan_s": {str(tp): round(t, 6) for tp, t in sorted(plans.items())},
            "best_total_s": round(plans.get(best, totals[cur.tp]), 6),
            "predicted_gain_s": round(gain, 6),
            "margin_s": round(margin, 6),
        }
        if self.predictor.calibration is not None:  # the table's correction by the steps seen, typical of cur
            details["calibration"] = round(self.predictor.calibration.typical(cur.tp), 4)
        if later:
            key = min(later, key=later.get)
            details["best_deferred"] = {"plan": key, "total_s": round(later[key], 6)}
        if wait:
            details["same_switch_later_s"] = {str(tp): round(t, 6) for tp, t in wait.items()}
        self.history.append(Evaluation(status.stage_decode_step, len(reqs), cur.tp, remaining, costs, chosen, details,
                                       targets))
        clear = chosen == cur.tp and not later and not wait and all(
            t >= (1 + self.config.clear_stay_frac) * totals[cur.tp] for tp, t in plans.items() if tp != cur.tp)
        self.clear_stay = (ClearStay(status.stage_decode_step, cur, ClearStay.key(status), status.speculation)
                           if clear and self.config.recheck_clear_stay_steps > 0 else None)
        if chosen == cur.tp:
            return None
        reason = (f"{self.estimator.name}: remaining {totals[cur.tp]:.3f}s at {cur} > "
                  f"{plans[chosen]:.3f}s switching to TP{chosen} now (switch {costs[chosen]['total_s']:.3f}s)")
        # kv_path None: the coordinator picks migrate/recompute from the exact move plan, with our rates
        return SwitchDecision(chosen, reason, None, details)

    def _still_clear(self, status: ClusterStatus) -> bool:
        """Whether the last evaluation's clear stay still stands: the same requests on the same layout, no
        new stage, its steps not run out, speculation's measurement as it was."""
        c = self.clear_stay
        return (c is not None and c.layout == status.layout and c.speculation == status.speculation
                and 0 <= status.stage_decode_step - c.stage_step < self.config.recheck_clear_stay_steps
                and c.requests == ClearStay.key(status))

    def _look_ahead(self, cur: Layout, reqs, as_is, rem, totals, costs, contexts):
        """Plans beyond Algorithm 1's "now or never" (lookahead.py); all on the first few draws.

        Returns switch-now totals per tp (best of Algorithm 1's and the lookahead's), deferred
        single-switch totals, the lookahead's switch-now values, and "the best switch a little
        later" values (all lookahead values are approximate; they are compared with each other)."""
        k = self.config.check_interval
        rem = rem[: self.config.lookahead_draws]
        fut = Future(np.asarray(contexts, float), np.array([r.cached for r in reqs]), rem)
        g_cur = np.full(len(reqs), -1)
        for g, idx in enumerate(as_is):
            g_cur[idx] = g
        g_cur = np.broadcast_to(g_cur, rem.shape)
        steps = deferral_steps(rem, 2 * k)
        layouts = {tp: Layout.for_world(cur.world, tp) for tp in costs}
        # later switches only go where a smaller batch runs faster (the batch only shrinks): higher TP
        # on GPUs, but not necessarily on CPUs, so ask the table
        solo = {tp: self.predictor.step_scalar(tp, 1, float(np.max(contexts))) for tp in [*costs, cur.tp]}
        now = {}
        for x in costs:  # switch now, then possibly once more
            onward = [layouts[y] for y in costs if solo[y] < solo[x]]
            now[x] = float(switch_value(self.predictor, fut, cur, g_cur, layouts[x], onward, steps).mean())
        plans = {tp: min(t, now.get(tp, t)) for tp, t in totals.items()}
        later: dict[str, float] = {}
        wait: dict[int, float] = {}
        best = min(now, key=now.get)
        if now[best] >= totals[cur.tp]:
            return plans, later, now, wait  # no switch plan beats staying: nothing to defer
        for x in costs:  # stay now, switch to x after s steps
            t = deferred(self.predictor, fut, cur, g_cur, layouts[x], steps).mean(axis=1)
            later.update({f"TP{x}@+{s}": float(v) for s, v in zip(steps, t)})
        onward = [layouts[y] for y in costs if solo[y] < solo[best]]
        for d in (k, 4 * k):  # the same switch a little later
            reach = drain_groups(self.predictor, cur, g_cur, fut.ctx, np.minimum(rem, d))
            value = reach + switch_value(self.predictor, fut.after(d), cur, g_cur, layouts[best], onward, steps)
            wait[best] = min(wait.get(best, float("inf")), float(value.mean()))
        return plans, later, now, wait
