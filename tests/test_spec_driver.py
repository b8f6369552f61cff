"""Speculative decoding in the driver, against fake workers (no processes, milliseconds).

The fake workers sample every position of a verify row and accept as the real TP leader
does (``speculative.verify.accept``), and their tokens are a pure function of (sequence,
position): so drafts, right or wrong, must never change a request's tokens. Block
invariants are checked after every tick: blocks taken for drafts go back when rejected,
and the workers' tables are cut to match (the fake pool refuses a write into a block
another sequence holds, and a table that does not cover a step's positions).
"""

from __future__ import annotations

import random

import pytest

from driver_fixtures import BLOCK, VOCAB, expected_tokens, make_driver, run_checked
from fake_workers import fake_token
from pat_engine.predictor.policy import ScheduledSwitches
from pat_engine.speculative.config import SpeculativeConfig

PROMPTS = [[1, 2, 3], [4] * 9, [5], [6] * 17, [7, 8], [9] * 5, [10] * 12, [11] * 2]
MAX_NEW = [12, 30, 7, 22, 40, 3, 18, 26]


class OracleProposer:
    """Proposes what the fake workers will sample, each token wrong with probability ``wrong``."""

    def __init__(self, wrong: float = 0.0, seed: int = 0):
        self.wrong, self.rng = wrong, random.Random(seed)
        self.tracked: set[int] = set()
        self.proposed: list[tuple[int, int, int]] = []  # (seq_id, length, k)

    def track(self, seq) -> None:
        self.tracked.add(seq.seq_id)

    def release(self, seq) -> None:
        self.tracked.discard(seq.seq_id)

    def propose(self, seq, k: int) -> list[int]:
        self.proposed.append((seq.seq_id, seq.length, k))
        draft = [fake_token(seq.seq_id, seq.length + j, VOCAB) for j in range(k)]
        return [(t + 1) % VOCAB if self.rng.random() < self.wrong else t for t in draft]


def spec_driver(proposer=None, max_active: int = 64, **kw):
    # adaptive off: every proposal runs whole (the fake steps' timings are noise; budget.py has its own tests)
    config = SpeculativeConfig(enabled=True, max_active=max_active, max_draft=kw.pop("max_draft", 4),
                               adaptive=kw.pop("adaptive", False))
    d = make_driver(numerics="invariant", speculative=config, **kw)
    if proposer is not None:
        d.coord.stepping.set_draft_proposer(proposer)
    return d


def assert_all_free(d) -> None:
    d.coord.stepping.check_block_invariants()
    for sched in d.coord.stepping.schedulers:
        assert sched.blocks.num_free == sched.blocks.num_blocks


def add_all(d, prompts=PROMPTS, max_new=MAX_NEW):
    return [d.add(p, m) for p, m in zip(prompts, max_new)]


def verify_steps(d):
    return [cmd for cmd in d.pool.steps if cmd.verify]


@pytest.mark.parametrize("wrong", [0.0, 0.3, 1.0])
def test_drafts_never_change_tokens_and_every_block_comes_back(wrong):
    oracle = OracleProposer(wrong, seed=1)
    d = spec_driver(oracle)
    seqs = add_all(d)
    run_checked(d)
    for s in seqs:
        assert s.finish_reason == "length" and s.output_ids == expected_tokens(s)
    assert_all_free(d)
    stats = d.coord.stepping.speculation_stats()
    assert stats["verify_steps"] > 0 and stats["drafted_tokens"] > 0
    if wrong == 0.0:
        assert stats["acceptance_rate"] == 1.0
        decode_steps = sum(1 for cmd in d.pool.steps if not cmd.is_prefill)
        assert decode_steps < max(MAX_NEW) // 2  # several tokens per step
    if wrong == 1.0:
        assert stats["accepted_tokens"] == 0
    assert any(cmd.truncated for cmd in d.pool.steps) == (wrong > 0)  # rejected drafts' blocks went back


def test_drafts_respect_the_length_caps():
    oracle = OracleProposer()
    d = spec_driver(oracle, max_draft=8)
    seqs = add_all(d)
    run_checked(d)
    by_id = {s.seq_id: s for s in seqs}
    for sid, length, k in oracle.proposed:
        s = by_id[sid]
        generated = length - len(s.prompt_ids)
        assert 1 <= k <= s.params.max_new_tokens - generated - 1
    assert all(len(s.output_ids) == s.params.max_new_tokens for s in seqs)


def test_speculation_waits_for_the_tail():
    oracle = OracleProposer()
    d = spec_driver(oracle, max_active=3)
    seqs = add_all(d)
    run_checked(d)
    assert all(s.output_ids == expected_tokens(s) for s in seqs)
    # a draft is only ever proposed while at most 3 requests are unfinished: the 3 longest ones
    longest = {s.seq_id for s in sorted(seqs, key=lambda s: -s.params.max_new_tokens)[:3]}
    assert oracle.proposed and {sid for sid, _, _ in oracle.proposed} <= longest


@pytest.mark.parametrize("wrong", [0.0, 0.5, 1.0])
def test_adaptive_draft_lengths_keep_tokens_and_blocks(wrong):
    d = spec_driver(OracleProposer(wrong, seed=2), max_draft=8, adaptive=True)
    seqs = add_all(d)
    run_checked(d)
    assert all(s.output_ids == expected_tokens(s) for s in seqs)
    assert_all_free(d)


def test_no_drafts_while_tokens_are_suppressed():
    oracle = OracleProposer()
    d = spec_driver(oracle, dp=1)
    s = d.add([3, 4, 5], 20, min_new_tokens=8, stop_token_ids=(999,))  # 999 is suppressed for 8 tokens
    run_checked(d)
    assert oracle.proposed and all(length - 3 >= 8 for _, length, _ in oracle.proposed)
    assert s.output_ids == expected_tokens(s)


def test_preemption_with_drafts_keeps_tokens_and_blocks_consistent():
    d = spec_driver(OracleProposer(0.4, seed=3), dp=1, kv_blocks=20)
    seqs = add_all(d)
    run_checked(d)
    assert sum(s.preemptions for s in seqs) > 0
    for s in seqs:
        assert s.output_ids == expected_tokens(s)
    assert_all_free(d)


@pytest.mark.parametrize("caching", [True, False])
def test_n_samples_with_drafts_share_blocks_and_keep_tokens(caching):
    d = spec_driver(OracleProposer(0.3, seed=5), dp=2, enable_prefix_caching=caching)
    prompt = list(range(100, 122))
    samples = d.add_samples(prompt, 17, n=4)
    other = d.add(prompt[:18] + [7, 7], 9)
    run_checked(d)
    for s in samples + [other]:
        assert s.output_ids == expected_tokens(s)
    assert verify_steps(d)
    assert_all_free(d)


@pytest.mark.parametrize("kv", ["migrate", "recompute"])
@pytest.mark.parametrize("schedule", [[(3, 2)], [(2, 2), (5, 1), (8, 2)]])
def test_live_switches_with_drafts(kv, schedule):
    d = spec_driver(OracleProposer(0.3, seed=7), tp=1, dp=2)
    seqs = add_all(d)
    seqs += d.add_samples(list(range(50, 61)), 25, n=3)
    d.coord.switching.start_stage(ScheduledSwitches(schedule, kv))
    run_checked(d)
    assert len(d.pool.plans) == len(schedule)
    for s in seqs:
        assert s.output_ids == expected_tokens(s)
    assert verify_steps(d)
    assert_all_free(d)


def test_a_table_cut_reaches_the_workers_before_its_blocks_are_reused():
    """Rejected drafts' blocks are freed at once; the next step of the group carries the cut,
    so a worker never holds a block of another sequence (the fake pool asserts it)."""
    d = spec_driver(OracleProposer(1.0), dp=1, kv_blocks=12, max_draft=8)
    a = d.add([1] * 3, 30)
    run_checked(d)
    cuts = [c for cmd in d.pool.steps for c in cmd.truncated]
    assert cuts and all(n * BLOCK >= 3 for _, n in cuts)
    assert a.output_ids == expected_tokens(a)
    assert_all_free(d)


def test_speculation_status_reaches_the_policy():
    d = spec_driver(OracleProposer(0.0), max_active=4)
    add_all(d)
    d.ticks(40)
    status = d.coord.stepping.status().speculation
    assert status is not None and status.max_active == 4
    assert status.measured and status.tokens_per_step > 1.0


def test_speculation_is_refused_where_it_would_not_be_exact():
    from pat_engine.config import EngineConfig
    from pat_engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="exact only with numerics='invariant' or dtype float64"):
        EngineConfig(model="m", dtype="bfloat16", speculative=SpeculativeConfig(enabled=True))
    EngineConfig(model="m", dtype="float64", speculative=SpeculativeConfig(enabled=True))
    EngineConfig(model="m", dtype="bfloat16", numerics="invariant", speculative=SpeculativeConfig(enabled=True))
    EngineConfig(model="m", dtype="bfloat16", speculative=SpeculativeConfig(enabled=True, allow_inexact=True))
    assert EngineConfig.from_kwargs("m", dtype="float64", speculative={"max_draft": 5}).speculative.max_draft == 5
    with pytest.raises(InvalidRequestError, match="unknown speculative option"):
        EngineConfig.from_kwargs("m", dtype="float64", speculative={"draft": 5})


def test_drafts_stay_within_the_step_token_budget():
    d = spec_driver(OracleProposer(), dp=1, max_draft=8, max_num_batched_tokens=24)
    seqs = add_all(d)
    run_checked(d)
    assert all(s.output_ids == expected_tokens(s) for s in seqs)
    assert verify_steps(d) and all(sum(len(s.token_ids) for s in cmd.seqs) <= 24 for cmd in verify_steps(d))


def test_pat_serve_flags_turn_speculation_on():
    import argparse

    from pat_engine.serve.engine_args import EngineArgs, add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = EngineArgs.from_namespace(p.parse_args(["--model", "m", "--speculative", "--speculative-history"]))
    assert args.speculative and args.speculative_history
    assert not EngineArgs.from_namespace(p.parse_args(["--model", "m"])).speculative


def test_remembered_responses_become_drafts():
    config = SpeculativeConfig(enabled=True, history=True, adaptive=False)
    d = make_driver(dp=1, numerics="invariant", speculative=config)
    prompt = [3, 1, 4, 1, 5]
    s = d.add(prompt, 6)
    d.ticks(1)  # prefilled: its first token is known
    first = s.output_ids[0]
    d.coord.stepping.remember_responses(prompt, [[first, 42, 43, 44, 45]])  # "5 first" is followed by 42 43 44 there
    run_checked(d)
    drafts = [step.token_ids[1:] for cmd in verify_steps(d) for step in cmd.seqs]
    assert drafts and drafts[0] == [42, 43, 44, 45]
    assert s.output_ids == expected_tokens(s)
