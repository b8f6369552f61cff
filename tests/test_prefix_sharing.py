"""Shared KV blocks in the driver: n samples of a prompt, the prefix cache, eviction, switches.

Fake workers (tests/fake_workers.py) refuse any step that writes a block another sequence holds,
so sharing mistakes fail here; token identity with transformers is in the slow suite.
"""

from __future__ import annotations

import pytest

from driver_fixtures import BLOCK, expected_tokens, make_driver, run_checked
from pat_engine.core.block_pool import BlockPool
from pat_engine.predictor.policy import ScheduledSwitches, SwitchDecision

PROMPT = list(range(100, 122))  # 22 tokens: 5 full blocks of 4 shareable (the last token always runs)


@pytest.mark.parametrize("caching", [True, False])
def test_n_samples_prefill_the_prompt_once_and_share_its_blocks(caching):
    d = make_driver(dp=2, enable_prefix_caching=caching)
    samples = d.add_samples(PROMPT, 6, n=4)
    assert len({s.group for s in samples}) == 1  # one group, so they can share
    d.ticks(3)
    prefills = [s for cmd in d.pool.steps if cmd.is_prefill for s in cmd.seqs]
    first = [p for p in prefills if p.seq_id == samples[0].seq_id]
    later = [p for p in prefills if p.seq_id != samples[0].seq_id]
    assert first[0].start_pos == 0 and len(first[0].token_ids) == len(PROMPT)
    assert later and all(p.start_pos == 20 and len(p.token_ids) == 2 for p in later)  # only the tail runs
    tables = [s.block_table for s in samples]
    assert all(t[:5] == tables[0][:5] for t in tables)  # the five full prompt blocks are one copy
    assert len({b for t in tables for b in t}) == 5 + 4  # shared prompt + each sample's own tail block
    run_checked(d)
    for s in samples:
        assert s.output_ids == expected_tokens(s)
    assert len({tuple(s.output_ids) for s in samples}) == 4  # different samples, different draws


def test_a_later_request_with_the_same_prefix_hits_the_cache():
    d = make_driver(dp=1)
    a = d.add(PROMPT, 3)
    run_checked(d)
    b = d.add(PROMPT[:18] + [7, 7, 7], 3)  # shares 4 full blocks (16 tokens) and part of the 5th
    d.ticks(1)
    step = d.pool.steps[-1]
    assert step.is_prefill and step.seqs[0].start_pos == 16
    stats = d.coord.stepping.prefix_cache_stats()
    assert stats["hit_tokens"] == 16 and stats["queried_tokens"] == len(PROMPT) + 21
    run_checked(d)
    assert a.output_ids == expected_tokens(a) and b.output_ids == expected_tokens(b)


def test_caching_off_means_no_hits_across_requests():
    d = make_driver(dp=1, enable_prefix_caching=False)
    d.add(PROMPT, 3)
    run_checked(d)
    d.add(PROMPT, 3)
    d.ticks(1)
    assert d.pool.steps[-1].seqs[0].start_pos == 0
    assert d.coord.stepping.prefix_cache_stats()["cached_blocks"] == 0


def test_cached_blocks_are_evicted_least_recently_used_only_when_needed():
    pool = BlockPool(6, BLOCK)
    a = pool.allocate(2)
    pool.register(a, list(range(8)), 0, 2, None)
    b = pool.allocate(2)
    pool.register(b, list(range(50, 58)), 0, 2, None)
    pool.free(a)
    pool.free(b)
    assert pool.num_cached == 4 and pool.num_free == 6
    assert pool.match_prefix(list(range(8)) + [1], None, 8) == a  # a is now the most recently used
    pool.free(a)
    taken = pool.allocate(4)  # 2 free, then 2 evicted: b's, the least recently used
    assert sorted(taken) == sorted([*set(range(6)) - set(a)])
    assert pool.match_prefix(list(range(50, 58)) + [1], None, 8) == []
    assert pool.match_prefix(list(range(8)) + [1], None, 8) == a
    assert pool.check([*a, *taken]) == []


def test_a_hash_collision_is_a_miss_not_a_wrong_block(monkeypatch):
    import pat_engine.core.block_pool as bp

    pool = BlockPool(4, BLOCK)
    monkeypatch.setattr(bp, "chain_key", lambda parent, tokens: 42)  # every block hashes alike
    a = pool.allocate(1)
    pool.register(a, [1, 2, 3, 4], 0, 1, None)
    pool.free(a)
    assert pool.match_prefix([9, 9, 9, 9, 9], None, 4) == []
    assert pool.match_prefix([1, 2, 3, 4, 9], None, 4) == a


@pytest.mark.parametrize("kv", ["migrate", "recompute"])
def test_a_switch_moves_shared_blocks_once_per_target_group(kv):
    d = make_driver(tp=1, dp=2)
    fam = d.add_samples(PROMPT, 12, n=4)
    other = d.add(list(range(300, 310)), 12)
    d.ticks(4)
    used_before = d.used_blocks()
    d.coord.switching.switch(SwitchDecision(2, "test", kv_path=kv))
    d.coord.stepping.check_block_invariants()
    plan = d.pool.plans[-1]
    if kv == "migrate":
        moved_blocks = sum(len(r.dst_table) for r in plan.runs)
        assert moved_blocks == used_before  # every block in use crossed once, shared ones too
        tables = {t.seq_id: t.block_table for t in plan.tables}
        assert all(tables[s.seq_id][:5] == tables[fam[0].seq_id][:5] for s in fam)  # still one shared copy
        assert d.used_blocks() == used_before
    else:
        assert plan.runs == () and d.coord.stepping.prefix_cache_stats()["cached_blocks"] == 0 and d.used_blocks() == 0
    run_checked(d)
    for s in [*fam, other]:
        assert s.output_ids == expected_tokens(s)


@pytest.mark.parametrize("kv", ["migrate", "recompute"])
def test_a_switch_counts_the_cached_prefixes_it_leaves_behind(kv):
    d = make_driver(tp=1, dp=2)
    done = d.add(PROMPT, 3)
    run_checked(d)  # its 5 full prompt blocks stay cached, used by no request
    cached = d.coord.stepping.prefix_cache_stats()["cached_blocks"]
    assert cached >= 5
    running = d.add(list(range(300, 330)), 12)
    d.ticks(3)
    event = d.coord.switching.switch(SwitchDecision(2, "test", kv_path=kv))
    assert event.costs["cached_blocks_dropped"] == cached
    assert d.coord.stepping.prefix_cache_stats()["cached_blocks"] == 0  # the running request's blocks are in use
    again = d.add(PROMPT, 3)  # the same prompt after the switch: prefilled from its first token
    run_checked(d)
    prefills = [p for cmd in d.pool.steps if cmd.is_prefill for p in cmd.seqs if p.seq_id == again.seq_id]
    assert prefills[0].start_pos == 0
    assert [s.output_ids for s in (done, running, again)] == [expected_tokens(s) for s in (done, running, again)]
    fresh = make_driver(tp=1, dp=2)
    assert fresh.coord.switching.switch(SwitchDecision(2, "test", kv_path=kv)).costs["cached_blocks_dropped"] == 0


@pytest.mark.parametrize("target_tp", [2, 1])
def test_a_switch_asked_to_keep_the_cache_moves_the_cached_prefixes_into_unused_blocks(target_tp):
    d = make_driver(tp=3 - target_tp, dp=target_tp, switch_keeps_prefix_cache=True)
    done = [d.add(PROMPT, 3), d.add(PROMPT[:8] + list(range(500, 514)), 3)]  # two prompts sharing 2 blocks
    run_checked(d)
    cached = d.coord.stepping.prefix_cache_stats()["cached_blocks"]
    running = d.add(list(range(300, 330)), 12)
    d.ticks(3)
    event = d.coord.switching.switch(SwitchDecision(target_tp, "test", kv_path="migrate"))
    d.coord.stepping.check_block_invariants()
    plan = d.pool.plans[-1]
    moved = sum(len(r.dst_table) for r in plan.runs) - len(running.block_table)
    assert moved == cached - event.costs["cached_blocks_dropped"] > 0
    assert d.coord.stepping.prefix_cache_stats()["cached_blocks"] == moved  # cached again in their new group
    # a split sends them to one of the new groups: a later turn goes where its prefix is cached, as
    # pat_integrations.turns.PrefixAffinity routes a conversation's turns
    d.coord.stepping.placement = lambda seq, groups: max(range(len(groups)), key=lambda g: groups[g].cached_tokens(seq))
    again = d.add(PROMPT, 3)
    run_checked(d)
    prefills = [p for cmd in d.pool.steps if cmd.is_prefill for p in cmd.seqs if p.seq_id == again.seq_id]
    assert prefills[0].start_pos == 20  # its five full blocks came with the switch
    for s in (*done, running, again):
        assert s.output_ids == expected_tokens(s)


@pytest.mark.parametrize("bandwidth, kv, kept", [(1e12, None, True), (1.0, None, False), (1e12, "recompute", False)])
def test_a_switch_no_request_holds_kv_for_prices_the_cached_prefixes_alone(monkeypatch, bandwidth, kv, kept):
    """Between rounds or turns nothing runs: the cached prefixes move if the cost model finds moving them
    cheaper than prefilling them again, and a forced recompute drops them."""
    d = make_driver(tp=1, dp=2, switch_keeps_prefix_cache=True)
    done = [d.add(PROMPT, 3), d.add(list(range(300, 330)), 3)]
    run_checked(d)
    cached = d.coord.stepping.prefix_cache_stats()["cached_blocks"]
    monkeypatch.setattr(d.coord.switching.cost_source, "bandwidth", lambda: bandwidth)
    event = d.coord.switching.switch(SwitchDecision(2, "test", kv_path=kv))
    d.coord.stepping.check_block_invariants()
    moved = sum(len(r.dst_table) for r in d.pool.plans[-1].runs)
    assert event.kv_path == ("migrate" if kept else "recompute")
    assert moved == (cached if kept else 0) and event.costs["cached_blocks_dropped"] == cached - moved
    assert ("predicted_migrate_s" in event.costs) == (kv is None)  # priced unless forced
    again = d.add(PROMPT, 3)
    run_checked(d)
    prefills = [p for cmd in d.pool.steps if cmd.is_prefill for p in cmd.seqs if p.seq_id == again.seq_id]
    assert prefills[0].start_pos == (20 if kept else 0)
    for s in (*done, again):
        assert s.output_ids == expected_tokens(s)


def test_samples_split_across_groups_by_a_switch_carry_the_prefix_to_each():
    d = make_driver(tp=2, dp=1)
    fam = d.add_samples(PROMPT, 20, n=4)
    d.ticks(4)
    d.coord.switching.switch(SwitchDecision(1, "test", kv_path="migrate"))
    groups = {s.group for s in fam}
    assert len(groups) == 2  # balanced across the two new groups
    plan = d.pool.plans[-1]
    prefix_runs = [r for r in plan.runs if r.num_tokens >= 20]
    assert len(prefix_runs) == 2  # the shared prompt went once to each group, not once per sample
    run_checked(d)
    for s in fam:
        assert s.output_ids == expected_tokens(s)


def test_schedules_with_samples_and_cache_keep_every_block_accounted():
    d = make_driver(tp=1, dp=2, kv_blocks=40)
    seqs = []
    for i in range(3):
        seqs += d.add_samples(PROMPT[: 10 + 4 * i], 15 + i, n=3)
    seqs.append(d.add(PROMPT, 25))
    d.coord.switching.start_stage(ScheduledSwitches([(2, 2), (6, 1), (9, 2)], None))
    run_checked(d)
    for s in seqs:
        assert s.output_ids == expected_tokens(s)
    d.coord.stepping.check_block_invariants()
    assert d.used_blocks() == 0


def test_a_flush_forgets_every_cached_prefix_and_keeps_the_blocks_accounted():
    d = make_driver(dp=1)
    d.add(PROMPT, 3)
    run_checked(d)
    running = d.add(PROMPT, 30)
    d.ticks(3)
    assert d.coord.stepping.prefix_cache_stats()["hit_tokens"] == 20
    d.coord.stepping.flush_prefix_cache()  # what a weight update does
    assert d.coord.stepping.prefix_cache_stats()["cached_blocks"] == 0
    d.coord.stepping.check_block_invariants()
    later = d.add(PROMPT, 3)
    d.ticks(1)
    assert d.pool.steps[-1].seqs[0].start_pos == 0  # nothing found: the prompt runs again
    run_checked(d)
    for s in (running, later):
        assert s.output_ids == expected_tokens(s)
