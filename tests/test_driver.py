"""The driver's logic against fake workers: routing, batching, preemption, switches, timeouts.

No processes: each test runs in milliseconds. Token exactness against transformers is
proven by the slow multi-process suites; here the fake workers' tokens are a pure function
of (sequence, position), so any scheduling mistake shows up as a wrong token.
"""

from __future__ import annotations

import pytest

from driver_fixtures import BLOCK, expected_tokens, make_driver, run_checked
from pat_engine.predictor.policy import ScheduledSwitches, SwitchDecision
from pat_engine.errors import LayoutError, WorkerFailure
from pat_engine.parallel.dp_placement import balance_by_context
from pat_engine.parallel.layout import Layout

PROMPTS = [[1, 2, 3], [4] * 9, [5], [6] * 17, [7, 8], [9] * 5, [10] * 12, [11] * 2]
MAX_NEW = [12, 30, 7, 22, 40, 3, 18, 26]


def add_all(driver, prompts=PROMPTS, max_new=MAX_NEW):
    return [driver.add(p, m) for p, m in zip(prompts, max_new)]


def assert_all_free(driver):
    driver.coord.stepping.check_block_invariants()
    for sched in driver.coord.stepping.schedulers:
        assert sched.blocks.num_free == sched.blocks.num_blocks


def test_requests_are_routed_to_the_group_with_fewest_outstanding_tokens():
    d = make_driver(dp=2)
    a = d.add([1] * 10, 50)  # 60 outstanding tokens -> group 0
    b = d.add([2] * 3, 4)  # group 1
    c = d.add([3] * 3, 4)  # group 1 (7 + 7 < 60)
    e = d.add([4] * 40, 40)  # group 1 (14 < 60)
    assert [s.group for s in (a, b, c, e)] == [0, 1, 1, 1]


def test_continuous_batching_generates_every_token_and_frees_every_block():
    d = make_driver(dp=2)
    seqs = add_all(d)
    d.run()
    for s in seqs:
        assert s.finish_reason == "length" and s.output_ids == expected_tokens(s)
    assert_all_free(d)


def test_preemption_by_recompute_keeps_tokens_and_blocks_consistent():
    d = make_driver(dp=1, kv_blocks=20)  # 80 slots for ~170 tokens of demand: decode must preempt
    seqs = add_all(d)
    for _ in range(10_000):
        if not d.coord.stepping.has_work():
            break
        d.coord.tick(0)
        d.coord.stepping.check_block_invariants()
    assert sum(s.preemptions for s in seqs) > 0
    for s in seqs:
        assert s.output_ids == expected_tokens(s)
    assert_all_free(d)


@pytest.mark.parametrize("kv", ["migrate", "recompute"])
@pytest.mark.parametrize("schedule", [[(4, 2)], [(3, 2), (9, 1)], [(2, 2), (5, 1), (8, 2), (12, 1)]])
def test_switch_schedules_keep_tokens_and_leak_no_block(kv, schedule):
    d = make_driver(tp=1, dp=2)
    seqs = add_all(d)
    d.coord.switching.start_stage(ScheduledSwitches(schedule, kv))
    for _ in range(10_000):
        if not d.coord.stepping.has_work() and d.coord.switching.pending is None:
            break
        d.coord.tick(0)
        d.coord.stepping.check_block_invariants()
    assert len(d.pool.plans) == len(schedule)
    assert all(p.kv_path == kv for p in d.pool.plans)
    for s in seqs:
        assert s.output_ids == expected_tokens(s)
    assert_all_free(d)


def test_a_recompute_switch_returns_the_blocks_it_reserved():
    # defect: the switch reserved blocks for migration, took the recompute path and never freed them
    d = make_driver(tp=1, dp=2, kv_blocks=32)
    add_all(d)
    d.ticks(12)
    d.coord.switching.switch(SwitchDecision(2, "test", kv_path="recompute"))
    assert d.pool.plans[-1].runs == () and d.pool.plans[-1].tables == ()
    d.coord.stepping.check_block_invariants()
    sched = d.coord.stepping.schedulers[0]
    assert sched.blocks.num_free == sched.blocks.num_blocks  # nothing runs until prefilled again
    d.run()
    assert_all_free(d)


def test_switch_places_requests_by_the_shared_balance_rule():
    d = make_driver(tp=2, dp=1)
    seqs = add_all(d)
    d.ticks(6)
    live = sorted(d.coord.stepping.unfinished(), key=lambda s: s.seq_id)
    lengths = [s.length for s in live]
    cached = {s.seq_id for s in live if s.num_cached}
    d.coord.switching.switch(SwitchDecision(1, "test", kv_path="migrate"))
    placement = balance_by_context(lengths, 2)
    for group, members in enumerate(placement):
        assert {live[i].group for i in members} == {group}
    plan = d.pool.plans[-1]
    assert plan.new == Layout(1, 2) and {t.seq_id for t in plan.tables} == cached
    d.run()
    for s in seqs:
        assert s.output_ids == expected_tokens(s)


def test_switch_target_that_cannot_hold_a_request_is_refused_before_anything_moves():
    d = make_driver(tp=2, dp=1, kv_blocks=24)  # 96 slots per group at TP2; TP1 (two KV heads per rank) holds 48
    d.add([1] * 10, 60)
    with pytest.raises(LayoutError, match="needs 72 KV slots but a DP group would hold 48"):
        d.coord.switching.switch(SwitchDecision(1, "test"))
    with pytest.raises(LayoutError, match="tp=3"):
        d.coord.switching.switch(SwitchDecision(3, "test"))
    assert d.pool.plans == []


def test_a_policy_asking_for_an_impossible_layout_is_recorded_not_fatal():
    d = make_driver(tp=1, dp=2)
    seqs = add_all(d)
    d.coord.switching.start_stage(ScheduledSwitches([(2, 8)]))  # 8 does not divide the world of 2
    d.run()
    refused = [e for e in d.coord.timeline.switches if not e.ok]
    assert refused and "refused" in refused[0].error
    assert all(s.output_ids == expected_tokens(s) for s in seqs)


def test_a_hung_group_becomes_a_worker_failure_within_the_step_timeout():
    d = make_driver(dp=2, step_timeout_s=0.05)
    d.pool.hung_groups.add(1)
    add_all(d)
    with pytest.raises(WorkerFailure, match="did not finish a step"):
        for _ in range(100_000):
            d.coord.tick(0.001)


def test_a_worker_error_reply_becomes_a_worker_failure_naming_the_rank():
    d = make_driver(dp=2)
    seqs = add_all(d)
    d.pool.failing_seqs.add(seqs[0].seq_id)
    with pytest.raises(WorkerFailure, match="rank 0 failed during a step: IndexError"):
        d.run()


def test_a_switch_failing_half_way_leaves_a_consistent_driver_after_reset():
    d = make_driver(tp=1, dp=2)
    seqs = add_all(d)
    d.ticks(8)
    d.pool.fail_switch = True
    with pytest.raises(WorkerFailure):
        d.coord.switching.switch(SwitchDecision(2, "test", kv_path="migrate"))
    # what the engine loop does after a failure: a fresh world in the base layout, everything recomputed
    d.pool.layout = Layout(1, 2)
    d.coord.restart(d.pool)
    d.coord.stepping.check_block_invariants()
    d.run()
    for s in seqs:
        assert s.output_ids == expected_tokens(s)
    assert_all_free(d)


def test_abort_frees_blocks_and_keeps_the_tokens_generated_so_far():
    d = make_driver(dp=1)
    seqs = add_all(d)
    d.ticks(10)
    victim = seqs[1]
    done_before = list(victim.output_ids)
    d.coord.stepping.abort([victim.seq_id], "abort")
    assert victim.finish_reason == "abort" and victim.output_ids == done_before
    d.coord.stepping.check_block_invariants()
    d.run()
    assert_all_free(d)


def test_block_invariant_check_catches_a_leak_and_a_double_owner():
    d = make_driver(dp=1)
    seqs = add_all(d)
    d.ticks(4)
    sched = d.coord.stepping.schedulers[0]
    sched.blocks.allocate(1)  # a block taken and owned by nobody
    with pytest.raises(AssertionError, match="reference counts differ"):
        d.coord.stepping.check_block_invariants()
    d2 = make_driver(dp=1)
    s2 = add_all(d2)
    d2.ticks(4)
    running = [s for s in s2 if s.block_table]
    running[1].block_table.append(running[0].block_table[0])
    with pytest.raises(AssertionError, match="reference counts differ"):
        d2.coord.stepping.check_block_invariants()
    assert seqs  # the first driver's requests are untouched by the check


def test_the_stage_decode_count_survives_a_switch_so_schedules_stay_on_time():
    d = make_driver(tp=1, dp=2)
    add_all(d)
    d.coord.switching.start_stage(ScheduledSwitches([(3, 2), (6, 1)], "migrate"))
    d.run()
    assert [str(p.new) for p in d.pool.plans] == ["TP2xDP1", "TP1xDP2"]
    assert BLOCK == d.coord.config.block_size


def test_an_installed_placement_with_rebalance_decides_where_a_switch_puts_requests():
    d = make_driver(tp=2, dp=1)
    seqs = add_all(d)
    d.ticks(3)

    class Reverse:
        def __call__(self, seq, schedulers):
            return 0

        def rebalance(self, live, groups):  # everything on the last group but the first request (by seq_id)
            return [[0]] + [[] for _ in range(groups - 2)] + [list(range(1, len(live)))]

    d.coord.stepping.placement = Reverse()
    live = sorted(d.coord.stepping.unfinished(), key=lambda s: s.seq_id)
    d.coord.switching.switch(SwitchDecision(1, "test", kv_path="migrate"))
    assert live[0].group == 0 and {s.group for s in live[1:]} == {1}
    d.run()
    for s in seqs:
        assert s.output_ids == expected_tokens(s)


def test_a_listener_that_raises_does_not_stop_the_engine():
    from pat_engine.core.request_handle import RequestHandle

    d = make_driver(dp=1)
    seq = d.add([1, 2, 3], 5)
    handle = RequestHandle(seq, None)
    handle.add_listener(lambda h: 1 / 0)
    d.run()
    assert handle.done() and seq.output_ids == expected_tokens(seq)


class _RecordingPolicy(ScheduledSwitches):
    """A schedule that notes, at each decision, whether every group with work had a step in flight (every
    device busy while it decides)."""

    def __init__(self, schedule, overlaps: bool, stepping):
        super().__init__(schedule, "migrate")
        self.overlaps_steps, self.stepping, self.busy = overlaps, stepping, []

    def decide(self, status):
        working = [g for g, sched in enumerate(self.stepping.schedulers) if sched.has_work()]
        self.busy.append(all(g in self.stepping.inflight for g in working))
        return super().decide(status)


@pytest.mark.parametrize("overlaps", [False, True])
def test_an_overlapping_policy_decides_while_the_next_steps_compute_and_its_switch_still_runs(overlaps):
    """On a GPU a policy that ``overlaps_steps`` (the controller: its arithmetic takes milliseconds) is asked
    right after the next steps are sent, so the device computes while it thinks; others are asked at the step
    boundary as before. Either way the switch it asks for runs, and tokens and blocks are kept."""
    d = make_driver(tp=1, dp=2)
    assert not d.coord.switching.overlap_decisions  # CPU workers compute on the host's cores: never there
    d.coord.switching.overlap_decisions = True  # as on a GPU
    seqs = add_all(d)
    policy = _RecordingPolicy([(3, 2), (6, 1)], overlaps, d.coord.stepping)
    d.coord.switching.start_stage(policy)
    run_checked(d)
    assert [str(p.new) for p in d.pool.plans] == ["TP2xDP1", "TP1xDP2"]
    assert policy.busy and all(policy.busy) == overlaps  # at the boundary the answered group is idle
    for s in seqs:
        assert s.output_ids == expected_tokens(s)
    assert_all_free(d)
