"""A later agent turn prefills only what is new: DP placement by cached prefix, and the turn ledger.

The driver runs over fake workers (no processes); a turn's prompt is the previous turn's prompt, its
response and a tool answer, as an agent loop builds it. Token identity through real engines, veRL's
agent loop and OpenRLHF's executor is in test_agent_turns.py.
"""

from __future__ import annotations

from driver_fixtures import BLOCK, make_driver, run_checked
from pat_integrations.turns import HEAD, PrefixAffinity, TurnLedger

TOOL = [7, 8, 9]  # the tool's answer, appended after each response


def next_turn(seq) -> list[int]:
    return list(seq.prompt_ids) + list(seq.output_ids) + TOOL


def cached_at_admission(d, seq) -> int:
    """Prompt tokens ``seq``'s prefill did not run (found in its group's prefix cache)."""
    step = next(s for cmd in d.pool.steps if cmd.is_prefill for s in cmd.seqs if s.seq_id == seq.seq_id)
    return step.start_pos


def answered(ledger: TurnLedger, *seqs) -> None:
    for seq in seqs:  # what the frontend records once an answer is back
        ledger.record(seq.prompt_ids, seq.output_ids, "v0")


def two_conversations(affinity: bool):
    """Turn 1 of A and B side by side (one per group), then their turn 2, B's first."""
    d = make_driver(dp=2)
    ledger = TurnLedger()
    if affinity:
        d.coord.stepping.set_placement(PrefixAffinity(ledger))
    a1, b1 = d.add(list(range(100, 111)), 6), d.add(list(range(200, 213)), 9)
    run_checked(d)
    answered(ledger, a1, b1)
    assert (a1.group, b1.group) == (0, 1)
    b2, a2 = d.add(next_turn(b1), 5), d.add(next_turn(a1), 5)
    run_checked(d)
    return d, (a1, a2), (b1, b2)


def test_each_turn_goes_where_its_earlier_turns_are_cached():
    d, (a1, a2), (b1, b2) = two_conversations(affinity=True)
    assert (a2.group, b2.group) == (a1.group, b1.group)
    for first, second in ((a1, a2), (b1, b2)):
        # every full block of turn 1 whose KV was computed: all but the last sampled token
        done = len(first.prompt_ids) + len(first.output_ids) - 1
        assert cached_at_admission(d, second) == done // BLOCK * BLOCK > 0


def test_without_affinity_the_idle_tie_sends_both_turns_to_group_0():
    d, (_, a2), (b1, b2) = two_conversations(affinity=False)
    assert b1.group == 1 and b2.group == 0 and cached_at_admission(d, b2) == 0


def test_a_conversation_stays_on_its_group_and_a_shared_prefix_alone_does_not_attract():
    d = make_driver(dp=2)
    ledger = TurnLedger()
    d.coord.stepping.set_placement(PrefixAffinity(ledger))
    a1 = d.add(list(range(100, 111)), 6)
    run_checked(d)
    answered(ledger, a1)
    long = d.add(list(range(300, 303)), 50)  # group 0, where a1 is cached, is now the loaded one
    assert long.group == 0
    a2 = d.add(next_turn(a1), 5)
    assert a2.group == 0  # its conversation's group, loaded or not (veRL's sticky sessions do the same)
    same_start = d.add(list(a1.prompt_ids) + [5, 5], 5)  # shares a1's prompt, continues no answer
    assert same_start.group == 1  # placed by load: fewest outstanding tokens
    run_checked(d)


def test_the_cache_query_of_a_placement_changes_nothing():
    d = make_driver(dp=1)
    a1 = d.add(list(range(100, 111)), 6)
    run_checked(d)
    sched = d.coord.stepping.schedulers[0]
    probe = d.factory.make(next_turn(a1), a1.params)
    stats, cached = d.coord.stepping.prefix_cache_stats(), sched.blocks.num_cached
    assert sched.cached_tokens(probe) == 16
    assert d.coord.stepping.prefix_cache_stats() == stats and sched.blocks.num_cached == cached


def test_the_ledger_knows_later_turns_and_resubmissions_of_this_stage_only():
    ledger = TurnLedger(capacity=3)
    short, long = [1, 2, 3], list(range(10, 10 + HEAD + 5))
    ledger.record(short, [4, 5], "v1")
    ledger.record(long, [6], "v1")
    assert ledger.continues(short + [4, 99, 100], "v1")  # the response re-rendered after its first token
    assert ledger.continues(long + [6] + TOOL, "v1")
    assert ledger.continues(short + [4], "v1")  # an aborted answer sent back with its tokens so far
    assert not ledger.continues(short, "v1")  # the same prompt again: a new sample, not a later turn
    assert not ledger.continues(short + [5], "v1") and not ledger.continues(long[:-1] + [0, 6], "v1")
    assert not ledger.continues(short + [4, 5], "v2")  # other weights: the cache is gone
    ledger.record([9], [], "v1")  # nothing generated: nothing to continue
    assert not ledger.continues([9, 1], "v1")
    for i in range(3):  # the oldest records go first
        ledger.record([50 + i], [0], "v1")
    assert not ledger.continues(short + [4, 5], "v1") and ledger.continues([52, 0, 1], "v1")
    ledger.record([60], [0], "v2")  # a new version starts over
    assert not ledger.continues([52, 0, 1], "v2") and ledger.continues([60, 0], "v2")
