"""Algorithm 1 on hand-built cluster states with a synthetic table whose answers are known.

World 4. Per-group step latency = base[tp] + per_request[tp] * b (plus a small
context term), so for B requests spread evenly:
    TP1xDP4: 10.0 + 0.10 B ms    TP2xDP2: 6.0 + 0.5 B ms    TP4xDP1: 4.0 + 2.0 B ms
TP1 wins for large batches, TP2 around 3-8 requests, TP4 for a single request.
"""

from __future__ import annotations

import pytest
from longtail.analytic import analytic_table, synthetic_deployment

from pat_engine.parallel.layout import Layout
from pat_engine.predictor.controller import ControllerConfig, SwitchController
from pat_engine.predictor.lengths import LengthDistribution, MaxLengthBound
from pat_engine.predictor.policy import ClusterStatus, GroupSnapshot, RequestSnapshot
from pat_engine.predictor.predictor import LatencyPredictor
from pat_engine.predictor.table import ModelShape, SwitchCost

BASE = {1: 0.010, 2: 0.006, 4: 0.004}
PER_REQUEST = {1: 0.0004, 2: 0.0010, 4: 0.0020}
FIXED_S = 0.05


def step(tp: int, b: int, total: float) -> float:
    return BASE[tp] + PER_REQUEST[tp] * b + 1e-8 * total / tp


def make_table():
    dep = synthetic_deployment(4, (1, 2, 4), "controller-test", "test")
    costs = [SwitchCost(a, b, FIXED_S, 1_000_000) for a in (1, 2, 4) for b in (1, 2, 4) if a != b]
    return analytic_table(dep, ModelShape(2, 4, 8, 4), step, lambda tp, b, l: 1e-5 * b * l,
                          (1, 2, 4, 8, 16, 32), (16, 128, 1024), 1e9, costs, "test")


def status(tp: int, groups: list[list[tuple[int, int]]], max_new: int = 1000, step_no: int = 64) -> ClusterStatus:
    """groups: per DP group, (prompt_len, generated) of each unfinished request."""
    layout = Layout.for_world(4, tp)
    assert len(groups) == layout.dp
    snaps = tuple(GroupSnapshot(g, tuple(RequestSnapshot(p, gen, max_new, True) for p, gen in reqs), 100, 100, None)
                  for g, reqs in enumerate(groups))
    return ClusterStatus(0.0, layout, snaps, step_no, 16)


def controller(estimator=None, **cfg) -> SwitchController:
    return SwitchController(LatencyPredictor(make_table(), max_num_seqs=64), estimator or MaxLengthBound(),
                            ControllerConfig(**cfg))


def spread(n: int, groups: int, generated: int) -> list[list[tuple[int, int]]]:
    return [[(32, generated) for _ in range(n // groups + (g < n % groups))] for g in range(groups)]


def test_stays_while_the_batch_is_large():
    ctrl = controller()
    assert ctrl.decide(status(1, spread(64, 4, 100))) is None
    ev = ctrl.history[-1]
    assert ev.chosen_tp == 1 and ev.remaining_s[1] < ev.remaining_s[2] < ev.remaining_s[4]
    assert ev.remaining_s[1] == pytest.approx(900 * step(1, 16, 0), rel=0.05)


def test_switches_when_the_tail_amortises_the_cost():
    ctrl = controller()
    decision = ctrl.decide(status(1, spread(6, 4, 500)))
    assert decision is not None and decision.tp == 2
    d = decision.details
    # the timeline shows why: predicted remaining times per candidate and the switch cost
    assert set(d["remaining_s"]) == {"1", "2", "4"} and set(d["switch_cost_s"]) == {"2", "4"}
    stay = float(d["remaining_s"]["1"])
    go = float(d["remaining_s"]["2"]) + d["switch_cost_s"]["2"]["total_s"]
    assert go < stay and d["predicted_gain_s"] == pytest.approx(stay - go, abs=1e-5)
    assert d["switch_cost_s"]["2"]["fixed_s"] == FIXED_S
    assert d["switch_cost_s"]["2"]["weights_s"] == pytest.approx(1e-3)


def test_stays_when_too_little_work_is_left_to_pay_for_the_switch():
    # same batch as above, but only 5 tokens each are left: saving ~9 ms cannot pay a 50 ms switch
    assert controller().decide(status(1, spread(6, 4, 995))) is None


def test_switches_twice_as_the_batch_shrinks():
    ctrl = controller()
    first = ctrl.decide(status(1, spread(6, 4, 300)))
    assert first is not None and first.tp == 2
    second = ctrl.decide(status(2, [[(32, 400)], []], step_no=400))
    assert second is not None and second.tp == 4
    # and never back while one request is left
    assert ctrl.decide(status(4, [[(32, 500)]], step_no=500)) is None


def test_hysteresis_margin_blocks_marginal_gains():
    # 8 requests: TP2 is ~7% faster per step than TP1; a 10% margin refuses, the default 2% accepts
    s = status(1, spread(8, 4, 0))
    assert controller(min_gain_frac=0.10).decide(s) is None
    assert controller().decide(s).tp == 2


def test_layouts_that_cannot_hold_the_batch_are_not_candidates():
    ctrl = controller()
    ctrl.can_hold = lambda layout, st: layout.tp != 2
    decision = ctrl.decide(status(1, spread(6, 4, 500)))
    assert decision is None or decision.tp == 4
    assert "2" not in ctrl.history[-1].details["remaining_s"]


def test_learned_lengths_avoid_the_early_switch_the_bound_makes():
    # 6 requests at 300 tokens with a 1000-token cap. The bound expects 700 more steps and switches.
    # An earlier stage showed every response ends by 320 tokens: ~20 steps left, not worth 50 ms.
    s = status(1, spread(6, 4, 300))
    assert controller().decide(s).tp == 2
    dist = LengthDistribution(draws=32)
    dist.add_stage(list(range(200, 321, 2)))
    ctrl = controller(dist)
    assert ctrl.decide(s) is None
    ev = ctrl.history[-1]
    assert ev.remaining_s[1] < 21 * step(1, 2, 0) * 1.05


def test_lookahead_waits_when_switching_later_pays_more():
    # 64 requests: 60 will stop at 50 tokens, 4 run to the 2000 cap (learned from an earlier stage).
    # TP2 for the rest of the stage beats TP1 for the rest of the stage (Algorithm 1 switches now),
    # but TP1 while the 60 short ones run, then TP2, is better still: the lookahead waits.
    def dist():
        d = LengthDistribution(draws=16)
        d.add_stage([50] * 60 + [2000] * 4, capped=[False] * 60 + [True] * 4)
        return d

    s = status(1, spread(64, 4, 8), max_new=2000, step_no=8)
    now_or_never = controller(dist(), lookahead=False).decide(s)
    assert now_or_never is not None and now_or_never.tp == 2
    patient = controller(dist())
    assert patient.decide(s) is None
    d = patient.history[-1].details
    assert d["best_deferred"]["total_s"] < d["plan_s"]["2"] < d["stay_s"]
    # once the short ones are done, it switches
    later = patient.decide(status(1, [[(32, 56)]] * 4, max_new=2000, step_no=56))
    assert later is not None and later.tp == 2


def test_the_switch_target_is_priced_with_the_placement_the_switch_uses():
    """With a placement rule that rebalances installed, the target the controller prices is where
    the switch then puts every request (not the longest-context-first default)."""
    from driver_fixtures import make_driver

    from pat_engine.parallel.dp_placement import balance_by_context
    from pat_engine.predictor.policy import SwitchDecision

    class Lopsided:  # the first request (by seq_id) alone on group 0, the rest on the last
        def __call__(self, seq, schedulers):
            return seq.seq_id % len(schedulers)

        def rebalance(self, requests, groups):
            return [[0]] + [[] for _ in range(groups - 2)] + [list(range(1, len(requests)))]

    d = make_driver(tp=1, dp=4)
    hook = Lopsided()
    d.coord.stepping.placement = hook
    for i in range(8):  # same prompt lengths: by context the default alternates them
        d.add([7 + i] * 4, 256)
    d.ticks(4)
    d.coord.stepping.drain()
    st = d.coord.stepping.status()
    assert st.placement is hook
    ctrl = controller()
    ctrl.decide(st)
    reqs = st.requests
    priced = {reqs[i].seq_id: g for g, members in enumerate(ctrl.history[-1].targets[2]) for i in members}
    by_context = {reqs[i].seq_id: g for g, members in enumerate(balance_by_context([r.context_len for r in reqs], 2))
                  for i in members}
    assert priced != by_context  # the two rules disagree here, so the check below can tell them apart
    d.coord.switching.switch(SwitchDecision(2, "test", kv_path="migrate"))
    placed = {s.seq_id: s.group for s in d.coord.stepping.unfinished()}
    assert placed == priced


# ---- speculative decoding: the tail's steps at the measured speed ---------------------------------


def _with_speculation(st: ClusterStatus, tokens_per_step: float, step_s: float, batch: float, max_active: int = 8):
    from dataclasses import replace

    from pat_engine.predictor.policy import SpeculationStatus

    spec = SpeculationStatus(max_active, tokens_per_step, step_s, batch, 100.0 * batch, st.layout.tp)
    return replace(st, speculation=spec)


def test_measured_speculation_divides_the_tails_remaining_time():
    plain = controller()
    plain.decide(status(1, spread(4, 4, 500)))
    # verify steps as slow as plain ones but 2.5 tokens each: the tail drains 2.5x faster
    ctrl = controller()
    ctrl.decide(_with_speculation(status(1, spread(4, 4, 500)), 2.5, step(1, 1, 100.0), 1.0))
    for tp in (1, 2, 4):
        assert ctrl.history[-1].remaining_s[tp] == pytest.approx(plain.history[-1].remaining_s[tp] / 2.5, rel=0.02)
    # above max_active the batch is priced as before (speculation is off there)
    big = controller()
    big.decide(_with_speculation(status(1, spread(64, 4, 100)), 2.5, step(1, 1, 100.0), 1.0))
    plain.decide(status(1, spread(64, 4, 100)))
    assert big.history[-1].remaining_s[1] == pytest.approx(plain.history[-1].remaining_s[1], rel=1e-9)


def test_unmeasured_speculation_changes_nothing():
    from dataclasses import replace

    from pat_engine.predictor.policy import SpeculationStatus

    a, b = controller(), controller()
    st = status(1, spread(6, 4, 500))
    a.decide(st)
    b.decide(replace(st, speculation=SpeculationStatus(8)))
    assert a.history[-1].remaining_s == b.history[-1].remaining_s


def test_a_tail_shorter_than_the_first_deferral_is_priced_without_deferrals():
    """Every request ends within two check intervals: the lookahead has no later step to switch at, and
    its plans are the switch-now ones (the engine loop died here once: an empty deferral grid)."""
    ctrl = controller(check_interval=1000)  # deferrals start at 2000 steps; 500 tokens are left
    decision = ctrl.decide(status(1, spread(6, 4, 500)))
    assert decision is not None and decision.tp == 2
    assert "best_deferred" not in decision.details  # no "stay now, switch after s steps" plan was priced


def test_a_clear_stay_is_priced_again_only_when_its_requests_or_layout_change_or_its_steps_run_out():
    # 64 requests: TP2 and TP4 are over twice as slow as staying, a clear stay
    ctrl = controller()
    batch = spread(64, 4, 100)
    assert ctrl.decide(status(1, batch, step_no=64)) is None and len(ctrl.history) == 1
    assert ctrl.clear_stay is not None
    assert ctrl.decide(status(1, spread(64, 4, 108), step_no=72)) is None
    assert len(ctrl.history) == 1 and ctrl.skipped == 1  # the same requests, 8 steps on: not priced
    one_done = [batch[0][1:], *batch[1:]]
    assert ctrl.decide(status(1, one_done, step_no=80)) is None and len(ctrl.history) == 2  # a finish: priced
    assert ctrl.decide(status(1, one_done, step_no=80 + 63)) is None and len(ctrl.history) == 2
    assert ctrl.decide(status(1, one_done, step_no=80 + 64)) is None and len(ctrl.history) == 3  # steps ran out
    assert ctrl.decide(status(1, one_done, step_no=8)) is None and len(ctrl.history) == 4  # a new stage
    ctrl.decide(status(2, spread(63, 2, 100), step_no=16))
    assert len(ctrl.history) == 5  # another layout


def test_a_close_stay_and_a_deferred_switch_are_priced_at_every_check():
    close = controller(min_gain_frac=0.10)  # TP2 ~7% faster, under the margin: a stay, not a clear one
    for step_no in (8, 16):
        assert close.decide(status(1, spread(8, 4, step_no), step_no=step_no)) is None
    assert len(close.history) == 2 and close.clear_stay is None
    off = controller(recheck_clear_stay_steps=0)
    for step_no in (64, 72):
        assert off.decide(status(1, spread(64, 4, step_no), step_no=step_no)) is None
    assert len(off.history) == 2 and off.skipped == 0
