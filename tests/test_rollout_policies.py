"""Pure-logic tests of the rollout layer: tail batching rounds and queue, SAGC, resume, the adapters' options."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from pat_engine.errors import InvalidRequestError
from pat_engine.rollout import (GroupSizeController, GroupSizingConfig, PromptEntry, RolloutConfig, RolloutScheduler,
                                RoundTracker, TailBatcher, TailBatchingConfig, straggler_ratio)
from pat_engine.rollout.resume import exactly_resumable, resume_request
from pat_engine.sampling.structured import StructuredOutput
from pat_engine.rollout.tail_batching import overprovision
from pat_engine.sampling.params import SamplingParams


def fresh(start: int = 0):
    counter = itertools.count(start)
    return lambda n: [PromptEntry(next(counter), f"p{k}") for k in range(n)]


# ---- tail batching -----------------------------------------------------------------------------------

def test_short_round_sizes_and_exact_boundary():
    tb = TailBatcher(0.25)
    plan = tb.plan(4, 8, fresh())
    assert plan.kind == "short" and len(plan.prompts) == 5 and plan.responses == 10
    assert (plan.accept_prompts, plan.accept_responses) == (4, 8)
    tr = RoundTracker(plan)
    # prompts 0..3 finish 8 responses each, interleaved; prompt 4 finishes 7 (one short of R0) first
    order = [(4, r) for r in range(7)]
    for r in range(8):
        order += [(p, r) for p in range(4)]
    events = []
    for ev in order:
        events.append(tr.on_finished(*ev))
    assert events.index(True) == len(order) - 1  # over exactly when prompt 3 gets its 8th response
    assert [p for p, _ in tr.accepted()] == [0, 1, 2, 3]
    assert tr.deferred() == [4]
    # the 8 accepted responses are the first 8 finished (0..7); 8 and 9 of prompts 0-3 are aborted
    assert all(rs == list(range(8)) for _, rs in tr.accepted())
    assert (4, 9) in tr.unfinished() and (0, 8) in tr.unfinished() and (4, 0) not in tr.unfinished()


def test_round_ends_when_p0th_prompt_completes_not_before():
    tb = TailBatcher(0.5)
    plan = tb.plan(2, 2, fresh())  # 3 prompts x 3 responses
    tr = RoundTracker(plan)
    assert not tr.on_finished(2, 1)
    assert not tr.on_finished(2, 0)  # prompt 2 complete: 1 of 2
    assert not tr.on_finished(0, 2)
    assert not tr.on_finished(1, 0)
    assert tr.on_finished(0, 0)  # prompt 0 complete: 2 of 2
    assert [p for p, _ in tr.accepted()] == [2, 0] and tr.deferred() == [1]
    assert tr.accepted()[1] == (0, [2, 0])  # finish order, not index order
    assert tr.on_finished(1, 1)  # ignored once over
    twice = RoundTracker(plan)
    twice.on_finished(0, 0)
    with pytest.raises(ValueError, match="twice"):
        twice.on_finished(0, 0)


def test_what_a_finish_makes_sure_to_be_returned():
    """``returned_with``: the responses a round (or, deferred, a later one) will surely return, answered once
    each, so the reward stage never scores one that no round returns; replayed against what the rounds
    return for every order of these finishes."""
    import itertools

    tb = TailBatcher(0.5)
    plan = tb.plan(2, 2, fresh())  # 3 prompts x 3 responses; R0 = 2, P0 = 2
    finishes = [(0, 2), (0, 0), (0, 1), (1, 1), (1, 2), (2, 0)]
    for order in itertools.permutations(finishes):
        tr, answered = RoundTracker(plan), []
        for p, r in order:
            if tr.done:
                break
            tr.on_finished(p, r)
            answered += [(p, x) for x in tr.returned_with(p, r)]
        returned = {(p, r) for p, rs in tr.accepted() for r in rs}
        returned |= {(p, r) for p in tr.deferred() for r in tr.finished[p] if r < plan.accept_of(p)}
        assert len(answered) == len(set(answered)) and set(answered) == returned, order


def test_queue_fills_and_long_round_takes_exactly_p0_oldest_without_overprovisioning():
    cfg = RolloutConfig(responses_per_step=16, group_size=4, tail_batching=TailBatchingConfig(eta=0.25))
    sched = RolloutScheduler(cfg, fresh(), default_length=10)
    kinds, deferred_uids = [], []
    for step in range(10):
        plan = sched.next_round()
        kinds.append(plan.kind)
        tr = RoundTracker(plan)
        lengths = {}
        if plan.kind == "short":
            assert len(plan.prompts) == 5 and plan.responses == 5
            # the last-launched prompt is slow; everything else finishes in index order
            for p in range(len(plan.prompts) - 1):
                for r in range(plan.responses):
                    lengths[(p, r)] = 5 + r
                    if tr.on_finished(p, r):
                        break
                if tr.done:
                    break
            deferred_uids.append(plan.prompts[-1].uid)
        else:
            assert len(plan.prompts) == 4 and plan.responses == 4
            assert [e.uid for e in plan.prompts] == deferred_uids[:4]  # FIFO: the 4 oldest deferred
            del deferred_uids[:4]
            for p in range(4):
                for r in range(4):
                    lengths[(p, r)] = 100
                    tr.on_finished(p, r)
        for p in range(len(plan.prompts)):
            for r in range(plan.responses):
                lengths.setdefault((p, r), 3)
        s = sched.finish_round(plan, tr, lengths)
        assert s.responses_returned == 16
    # 4 short rounds each defer 1 prompt -> the 5th step is a long round (RollPacker's period of 5)
    assert kinds == ["short"] * 4 + ["long"] + ["short"] * 4 + ["long"]
    assert sched.queue_len == 0


def finite(entries: list[PromptEntry]):
    """A finite prompt stream (a pat-serve batch file): draw(n) gives what is left, then nothing."""
    left = list(entries)

    def draw(n: int) -> list[PromptEntry]:
        taken, left[:] = left[:n], left[n:]
        return taken

    return draw


def test_a_finite_stream_ends_with_a_final_long_round_of_whatever_is_queued():
    tb = TailBatcher(0.5)
    draw = finite([PromptEntry(u, f"p{u}") for u in range(5)])
    first = tb.plan(2, 2, draw)  # 3 of 5 prompts, 2 returned
    assert first.kind == "short" and [e.uid for e in first.prompts] == [0, 1, 2] and first.accept_prompts == 2
    tb.defer([first.prompts[2]])
    second = tb.plan(2, 2, draw)  # only 2 fresh prompts left: both must finish, nothing can be deferred
    assert second.kind == "short" and [e.uid for e in second.prompts] == [3, 4] and second.accept_prompts == 2
    tr = RoundTracker(second)
    for r in range(2):
        tr.on_finished(0, r)
    assert not tr.done  # one prompt complete is not enough when the round holds only P0
    tr.on_finished(1, 2)
    assert tr.on_finished(1, 0) and tr.deferred() == []
    last = tb.plan(2, 2, draw)  # the stream is empty: the one queued prompt runs alone, no over-provisioning
    assert (last.kind, [e.uid for e in last.prompts], last.accept_prompts, last.launched) == ("long", [2], 1, 2)
    assert tb.plan(2, 2, draw).prompts == ()  # nothing left at all
    single = TailBatcher(0.5).plan(2, 2, finite([PromptEntry(9, "x")]))
    assert single.kind == "short" and single.accept_prompts == 1  # fewer than P0 left: all of them


def test_each_prompt_may_bring_its_own_response_count():
    tb = TailBatcher(0.5)
    entries = [PromptEntry(0, "a", responses=1), PromptEntry(1, "b", responses=3), PromptEntry(2, "c")]
    plan = tb.plan(2, 2, finite(entries))
    assert [plan.launch_of(p) for p in range(3)] == [2, 5, 3] and plan.launched == 10
    assert [plan.accept_of(p) for p in range(3)] == [1, 3, 2]
    tr = RoundTracker(plan)
    assert not tr.on_finished(0, 1)  # prompt 0 complete after one response
    for r in (4, 0):
        assert not tr.on_finished(1, r)
    assert tr.on_finished(1, 2)  # prompt 1's third finished response closes the round
    assert tr.accepted() == [(0, [1]), (1, [4, 0, 2])] and tr.deferred() == [2]
    assert (0, 0) in tr.unfinished() and (1, 3) in tr.unfinished() and (1, 4) not in tr.unfinished()
    tb.defer([entries[1]])
    tb.queue.appendleft(entries[0])
    long = tb.plan(2, 2, finite([]))  # a long round runs each prompt's own count, not over-provisioned
    assert long.kind == "long" and [long.launch_of(p) for p in range(2)] == [1, 3]


def test_overprovision_rounds_up():
    assert overprovision(8, 0.25) == 10 and overprovision(3, 0.25) == 4 and overprovision(4, 0.0) == 4


def test_config_validation_names_the_problem():
    with pytest.raises(InvalidRequestError, match="multiple"):
        RolloutConfig(responses_per_step=10, group_sizing=GroupSizingConfig(sizes=(4, 8)))
    with pytest.raises(InvalidRequestError, match="eta"):
        TailBatchingConfig(eta=-1)
    with pytest.raises(InvalidRequestError, match="initial"):
        GroupSizingConfig(sizes=(4, 8), initial=16)


# ---- SAGC ---------------------------------------------------------------------------------------------

def test_straggler_ratio():
    assert straggler_ratio([10, 10, 30]) == 3.0
    assert straggler_ratio([4, 6]) == 6 / 5
    assert straggler_ratio([]) == 1.0


def test_dual_update_is_projected_ascent_and_posterior_discounted():
    cfg = GroupSizingConfig(sizes=(4, 8, 16), target_rate=0.25, dual_step=2.0, dual_max=3.0, forgetting=0.5,
                            straggler_threshold=1.25)
    c = GroupSizeController(cfg)
    strag, calm = [10, 10, 20], [10, 10, 11]
    obs = c.observe(8, [strag, strag, calm, calm])  # rate 0.5
    assert obs.stragglers == 2 and obs.dual == pytest.approx(2.0 * (0.5 - 0.25))
    assert (c.alpha[8], c.beta[8]) == (0.5 * 1 + 2, 0.5 * 1 + 2)
    obs = c.observe(8, [strag] * 4)  # rate 1: 0.5 + 1.5 = 2.0
    assert obs.dual == pytest.approx(2.0)
    assert c.observe(8, [strag] * 4).dual == 3.0  # projected onto [0, dual_max]
    c2 = GroupSizeController(cfg)
    assert c2.observe(4, [calm] * 4).dual == 0.0  # projected at 0
    assert (c2.alpha[16], c2.beta[16]) == (1.0, 1.0)  # other sizes untouched


def test_neighbor_moves_and_convergence():
    cfg = GroupSizingConfig(sizes=(4, 8, 16), target_rate=0.2, dual_step=1.0, seed=3)
    calm = GroupSizeController(cfg)
    seen = []
    for _ in range(30):
        g = calm.choose()
        seen.append(g)
        calm.observe(g, [[10, 10, 10]] * (64 // g))
    assert seen[0] in (8, 16) and seen[-1] == 16  # never straggles: the largest group wins
    assert all(abs(cfg.sizes.index(a) - cfg.sizes.index(b)) <= 1 for a, b in zip(seen, seen[1:]))
    stormy = GroupSizeController(cfg)
    seen = []
    for _ in range(60):
        g = stormy.choose()
        seen.append(g)
        # small groups rarely straggle, large groups always
        groups = [[10, 10, 40]] * (64 // g) if g >= 8 else [[10, 10, 10]] * (64 // g)
        stormy.observe(g, groups)
    assert seen[-10:].count(4) >= 8 and stormy.dual > 0


# ---- resume convention --------------------------------------------------------------------------------

def test_resume_request_reduces_budgets():
    p = SamplingParams(max_new_tokens=20, min_new_tokens=8, temperature=1.0, seed=5)
    prompt, rest = resume_request([1, 2], [7, 8, 9], p)
    assert prompt == [1, 2, 7, 8, 9] and rest.max_new_tokens == 17 and rest.min_new_tokens == 5 and rest.seed == 5
    _, rest = resume_request([1], list(range(10)), p)
    assert rest.min_new_tokens == 0
    with pytest.raises(InvalidRequestError, match="seed"):
        resume_request([1], [2], SamplingParams(max_new_tokens=4, temperature=1.0))
    with pytest.raises(InvalidRequestError, match="nothing left"):
        resume_request([1], [2, 3], SamplingParams(max_new_tokens=2))


def test_what_reads_the_response_itself_is_not_resumed_from_a_partial():
    base = SamplingParams(max_new_tokens=8, temperature=1.0, seed=1, logprobs=True, repetition_penalty=1.2)
    assert exactly_resumable(base)  # repetition counts prompt and response alike: the continuation sees both
    for change in (dict(stop=("x",)), dict(frequency_penalty=0.5), dict(presence_penalty=0.5),
                   dict(top_logprobs=2), dict(prompt_logprobs=1),
                   dict(structured_output=StructuredOutput.of(regex="[a-z]+"))):
        assert not exactly_resumable(replace(base, **change)), change


# ---- adapters: the options they map, veRL's partial rollout made exact -------------------------------

def test_rollout_options_map_onto_the_rollout_config_with_named_errors():
    from pat_integrations.rollout_options import rollout_config

    assert rollout_config({}, 8, "x") is None and rollout_config({"tail_batching": False}, 8, "x") is None
    cfg = rollout_config({"responses_per_step": 64, "tail_batching": True}, 8, "x")
    assert cfg.group_size == 8 and cfg.tail_batching == TailBatchingConfig() and cfg.group_sizing is None
    cfg = rollout_config({"responses_per_step": 64, "group_sizing": {"sizes": [8, 4], "target_rate": 0.2}}, 8, "x")
    assert cfg.group_sizing.sizes == (4, 8) and cfg.group_sizing.target_rate == 0.2
    for options, match in [({"tail_batching": True}, "x.responses_per_step is required"),
                           ({"responses_per_step": 64, "tail_batching": "yes"}, "x.tail_batching must be true"),
                           ({"responses_per_step": 64, "tail_batching": {"eta": 5}}, "x.tail_batching: .*eta"),
                           ({"responses_per_step": 64, "group_sizing": {"size": [4]}}, r"unknown x.group_sizing .*size"),
                           ({"responses_per_step": 60, "tail_batching": True}, "multiple of every group size"),
                           ({"responses_per_step": True, "tail_batching": True}, "positive integer")]:
        with pytest.raises(ValueError, match=match):
            rollout_config(options, 8, "x")


def test_partial_ledger_continues_an_aborted_request_with_its_seed():
    from pat_engine.outputs import RequestOutput
    from pat_integrations.partials import PartialLedger

    ledger = PartialLedger(seed=3, capacity=2)
    asked = SamplingParams(max_new_tokens=20, min_new_tokens=8, temperature=1.0)
    params, origin = ledger.prepare([1, 2], asked, "req-a")
    assert params.seed is not None and params == replace(asked, seed=params.seed)  # pinned, nothing else changed
    assert ledger.prepare([1, 2], asked, "req-a")[0].seed == params.seed  # derived from the server seed and id
    ledger.settle(origin, RequestOutput("req-a", [1, 2], [7, 8, 9], None, "abort"))
    # veRL's client sends prompt + tokens so far with max_tokens lowered, the rest as it was
    again, origin2 = ledger.prepare([1, 2, 7, 8, 9], replace(asked, max_new_tokens=17), "req-b")
    assert again == replace(params, max_new_tokens=17, min_new_tokens=5) and len(ledger) == 0
    ledger.settle(origin2, RequestOutput("req-b", [1, 2, 7, 8, 9], [4], None, "abort"))  # aborted twice
    third, _ = ledger.prepare([1, 2, 7, 8, 9, 4], replace(asked, max_new_tokens=16), "req-c")
    assert third == replace(params, max_new_tokens=16, min_new_tokens=4)
    # finished answers are not kept; stop strings read the response itself: continued as asked, not exactly
    ledger.settle(origin, RequestOutput("req-a", [1, 2], [5], None, "stop"))
    assert len(ledger) == 0
    stop = replace(asked, stop=("x",))
    params, origin = ledger.prepare([3], stop, "req-d")
    ledger.settle(origin, RequestOutput("req-d", [3], [6], None, "abort"))
    assert ledger.prepare([3, 6], replace(stop, max_new_tokens=19), "req-e")[0].max_new_tokens == 19
    for k in range(3):  # bounded: the oldest open partials go first
        _, o = ledger.prepare([k], asked, f"cap-{k}")
        ledger.settle(o, RequestOutput(f"cap-{k}", [k], [1], None, "abort"))
    assert len(ledger) == 2
