"""Real-engine tests of the rollout layer (float64, worker processes): exact resume and tail-batched rounds."""

from __future__ import annotations

import itertools
from dataclasses import replace
import threading

import pytest

from pat_engine import Engine, SamplingParams
from pat_engine.rollout import PromptEntry, RolloutConfig, RolloutScheduler, TailBatchingConfig
from pat_engine.rollout.resume import join_outputs, resume_request
from pat_engine.rollout.runner import RolloutRunner

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7], [100, 20, 30, 40, 50, 60, 70], [9], [250, 251], [300, 12, 13, 14, 15], [17, 18]]


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float64") as e:
        yield e


def abort_after(engine, prompt, params, k):
    """Submit, abort once at least k tokens exist; the aborted output keeps them."""
    handle = engine.submit(prompt, params)
    reached = threading.Event()
    handle.add_listener(lambda h: reached.set() if h.num_generated >= k else None)
    reached.wait(60)
    engine.abort([handle.request_id])
    handle.wait(60)
    return handle.output()


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=True),
    SamplingParams(max_new_tokens=40, temperature=1.0, top_p=0.9, seed=1234, min_new_tokens=30, logprobs=True),
], ids=["greedy", "seeded"])
def test_abort_and_resume_equals_uninterrupted(engine, params):
    prompt = PROMPTS[1]
    full = engine.generate([prompt], params, use_tqdm=False)[0]
    part = abort_after(engine, prompt, params, 7)
    assert part.finish_reason == "abort" and 7 <= len(part.token_ids) < 40
    assert part.token_ids == full.token_ids[: len(part.token_ids)]
    new_prompt, rest = resume_request(part.prompt_token_ids, part.token_ids, params)
    cont = engine.generate([new_prompt], rest, use_tqdm=False)[0]
    joined = join_outputs(part.prompt_token_ids, part.token_ids, part.logprobs, cont)
    assert joined.token_ids == full.token_ids
    assert joined.logprobs == pytest.approx(full.logprobs, abs=1e-9)


def lengths_of(uid: int, r: int) -> int:
    return 24 if uid % 3 == 2 else 3 + 2 * r  # every third prompt is long-tail


def make_runner(engine, eta=0.5, seed=0):
    counter = itertools.count()
    draw = lambda n: [PromptEntry(u, PROMPTS[u % len(PROMPTS)], metadata={"uid": u})
                      for u in (next(counter) for _ in range(n))]
    cfg = RolloutConfig(responses_per_step=4, group_size=2, tail_batching=TailBatchingConfig(eta=eta))
    sched = RolloutScheduler(cfg, draw, default_length=10)

    def params_for(entry, r):
        return SamplingParams(max_new_tokens=lengths_of(entry.uid, r), temperature=1.0, ignore_eos=True,
                              seed=1000 * entry.uid + r, logprobs=True)

    return RolloutRunner(engine, sched, params_for, seed=seed), params_for


def reference(engine, entry, params):
    return engine.generate([entry.prompt], params, use_tqdm=False)[0].token_ids


def test_tail_batched_rounds_return_exact_outputs_and_resume_deferred(engine):
    runner, params_for = make_runner(engine)
    # step 0: 3 prompts (uids 0,1,2) x 3 responses; uid 2 is long -> deferred
    s0 = runner.step()
    assert s0.summary.kind == "short" and s0.summary.responses_launched == 9
    assert sorted(e.uid for e, _ in s0.groups) == [0, 1] and s0.summary.prompts_deferred == 1
    for entry, outs in s0.groups:
        assert len(outs) == 2
        for o in outs:
            r = int(o.request_id.rsplit("-r", 1)[1])
            assert o.token_ids == reference(engine, entry, params_for(entry, r))
    # step 1: uids 3,4,5; uid 5 deferred; the queue now holds 2 = P0 -> step 2 is the long round
    s1 = runner.step()
    assert s1.summary.kind == "short" and runner.scheduler.queue_len == 2
    s2 = runner.step()  # same weights: the deferred partials resume exactly
    assert s2.summary.kind == "long" and s2.summary.responses_launched == 4 and s2.resumed >= 1
    assert sorted(e.uid for e, _ in s2.groups) == [2, 5] and s2.stale_regenerated == 0
    for entry, outs in s2.groups:
        for r, o in enumerate(outs):
            assert len(o.token_ids) == 24
            assert o.token_ids == reference(engine, entry, params_for(entry, int(o.request_id.rsplit("-r", 1)[1])))


def test_stale_partials_are_regenerated_from_the_prompt(engine):
    runner, params_for = make_runner(engine)
    runner.step()
    runner.step()
    runner.weights_updated()  # what an RL loop does after update_weights
    s2 = runner.step()
    assert s2.summary.kind == "long" and s2.resumed == 0 and s2.stale_regenerated >= 1
    for entry, outs in s2.groups:
        for o in outs:
            assert o.token_ids == reference(engine, entry, params_for(entry, int(o.request_id.rsplit("-r", 1)[1])))


def test_engine_uses_the_placement_hook_and_outputs_do_not_change(engine):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in engine.generate(PROMPTS, params, use_tqdm=False)]
    calls = []

    def all_on_group_one(seq, schedulers):
        calls.append(len(schedulers))
        return 1

    engine.set_placement(all_on_group_one)
    try:
        handles = [engine.submit(p, params) for p in PROMPTS]
        for h in handles:
            h.wait(60)
        assert calls == [2] * len(PROMPTS) and {h.dp_group for h in handles} == {1}
        assert [h.output().token_ids for h in handles] == ref
    finally:
        engine.set_placement(None)


def test_rewards_stream_during_the_round_and_score_resumed_responses_whole(engine):
    from pat_engine.rollout.rewards import RewardConfig, RewardStage

    scored = []

    def score(item) -> float:  # a function of the whole response; prompt 4's verifier crashes
        out = item.output
        scored.append(out.request_id)
        if item.prompt != out.prompt_token_ids or PROMPTS[item.metadata["uid"] % len(PROMPTS)] != item.prompt:
            raise AssertionError("the reward got another prompt's prompt or metadata")
        if out.prompt_token_ids == PROMPTS[4]:
            raise RuntimeError("sandbox error")
        return float(len(out.token_ids) + sum(out.token_ids) % 7)

    with RewardStage(score, RewardConfig(max_workers=2, timeout_s=30)) as stage:
        runner, params_for = make_runner(engine)
        runner.rewards = stage
        # a long-tail prompt's first response is short: it finishes in the round that defers its prompt
        runner.params_for = lambda e, r: (replace(params_for(e, r), max_new_tokens=3) if e.uid % 3 == 2 and r == 0
                                          else params_for(e, r))
        steps = [runner.step() for _ in range(3)]  # short, short, long (resumes the deferred partials)
    assert steps[2].summary.kind == "long" and steps[2].resumed >= 1
    # a deferred prompt's finished response comes back as it was: scored once, when it finished
    assert len(scored) == sum(len(outs) for s in steps for _, outs in s.groups)
    for s in steps:
        returned = [o for _, outs in s.groups for o in outs]
        assert [len(r) for r in s.rewards] == [len(outs) for _, outs in s.groups]  # every response has its result
        results = [r for group in s.rewards for r in group]
        assert all(r.error == "crashed: RuntimeError: sandbox error" for r in results if not r.ok)
        assert sum(not r.ok for r in results) == sum(o.prompt_token_ids == PROMPTS[4] for o in returned)
        # each result is its own response's, and resumed responses are scored whole (the partial's tokens too)
        for r, o in zip(results, returned):
            assert r.ok == (o.prompt_token_ids != PROMPTS[4])
            assert not r.ok or r.reward == float(len(o.token_ids) + sum(o.token_ids) % 7)
