"""Shared KV blocks change nothing (float64): n samples, the prefix cache, under layouts and switches.

- Greedy continuations of prompts that share a long system prompt (prefix-cache hits) equal
  transformers token for token.
- n seeded samples of one prompt equal n separate requests seeded ``sample_seed(seed, i)`` (the
  same draws without any sharing), in every layout, with prefix caching on and off, and under a
  switch schedule with both KV paths.
"""

from __future__ import annotations

import pytest

from conftest import hf_greedy
from pat_engine import Engine, SamplingParams
from pat_engine.sampling.seeds import sample_seed
from waiting import wait_for

pytestmark = pytest.mark.slow  # starts worker processes

SYSTEM = [(7 * i + 3) % 250 + 1 for i in range(37)]  # 37 tokens: two full blocks of 16 shared, then a tail
QUESTIONS = [[11, 12], [13, 14, 15, 16, 17], [18], [19, 20, 21]]
PROMPT = [5, 6, 7, 8, 9] * 7  # 35 tokens
N = 4
PARAMS = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=123, n=N, logprobs=True)


def singles(params: SamplingParams) -> list[SamplingParams]:
    from dataclasses import replace

    return [replace(params, n=1, seed=sample_seed(params.seed, i)) for i in range(params.n)]


@pytest.fixture(scope="module")
def reference(model_dir):
    """The n samples as n unrelated requests, on one rank with caching off."""
    with Engine(model_dir("llama"), tp=1, dp=1, dtype="float64", enable_prefix_caching=False) as engine:
        outs = engine.generate([PROMPT] * N, singles(PARAMS), use_tqdm=False)
    return [(o.token_ids, o.logprobs) for o in outs]


def test_prefix_cache_hits_keep_greedy_tokens_equal_to_transformers(model_dir):
    path = model_dir("llama")
    prompts = [SYSTEM + q for q in QUESTIONS]
    with Engine(path, tp=2, dp=1, dtype="float64") as engine:
        first = engine.generate(prompts[:1], SamplingParams(max_new_tokens=24), use_tqdm=False)
        rest = engine.generate(prompts[1:], SamplingParams(max_new_tokens=24), use_tqdm=False)
        stats = engine.prefix_cache_stats()
    assert stats["hit_tokens"] >= 3 * 32  # every later prompt found the system prompt's two full blocks
    for prompt, out in zip(prompts, first + rest):
        assert out.token_ids == hf_greedy(path, prompt, 24)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_n_samples_equal_separate_requests_in_every_layout(model_dir, reference, tp, dp, caching):
    with Engine(model_dir("llama"), tp=tp, dp=dp, dtype="float64", enable_prefix_caching=caching) as engine:
        out = engine.generate([PROMPT], PARAMS, use_tqdm=False)[0]
    assert len(out.samples) == N and [s.sample_index for s in out.samples] == list(range(N))
    assert out.token_ids == out.samples[0].token_ids
    for i, sample in enumerate(out.samples):
        tokens, logprobs = reference[i]
        assert sample.token_ids == tokens, f"TP{tp}xDP{dp} caching={caching}: sample {i} differs"
        assert sample.logprobs == pytest.approx(logprobs, abs=1e-9)


@pytest.mark.parametrize("kv", ["migrate", "recompute"])
def test_n_samples_survive_switch_schedules(model_dir, reference, kv):
    with Engine(model_dir("llama"), tp=1, dp=4, dtype="float64") as engine:
        out = engine.generate([PROMPT, SYSTEM + [3]], [PARAMS, SamplingParams(max_new_tokens=30)],
                              switch_schedule=[(3, 2), (8, 4), (14, 1)], kv_transfer=kv, use_tqdm=False)
        assert len(engine.switches) == 3
    for i, sample in enumerate(out[0].samples):
        assert sample.token_ids == reference[i][0]


@pytest.mark.parametrize("tp,dp,target,idle", [(1, 2, 2, False), (2, 1, 1, False), (1, 2, 2, True)])
def test_cached_prefixes_a_switch_keeps_hold_the_kv_a_prefill_would(model_dir, tp, dp, target, idle):
    """``switch_keeps_prefix_cache``: a migrating switch moves the cached prefixes no request holds (a merge,
    and a split sending them to one group; ``idle``: a switch no request holds KV for, between turns); the
    same prompts after it hit them and continue as transformers."""
    path = model_dir("llama")
    prompts = [SYSTEM + q for q in QUESTIONS]
    with Engine(path, tp=tp, dp=dp, dtype="float64", switch_keeps_prefix_cache=True) as engine:
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=4), use_tqdm=False)  # cached, then unused
        if not idle:
            running = engine.submit([3] * 20, SamplingParams(max_new_tokens=400, ignore_eos=True))
            wait_for(lambda: running.num_generated >= 2)  # it holds KV, so the switch migrates
        cached = engine.prefix_cache_stats()["cached_blocks"]
        event = engine.reconfigure(target, kv_transfer="migrate")
        # later turns go where their prefix is cached (as pat_integrations.turns.PrefixAffinity routes them)
        engine.set_placement(lambda seq, groups: max(range(len(groups)), key=lambda g: groups[g].cached_tokens(seq)))
        hits = engine.prefix_cache_stats()["hit_tokens"]
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=24), use_tqdm=False)
        found = engine.prefix_cache_stats()["hit_tokens"] - hits
        if not idle:
            engine.abort([running.request_id])
    # two prompts prefilled in one step cached a copy each of the system prompt's blocks: one copy moves
    assert event.kv_path == "migrate" and event.costs["cached_blocks_dropped"] <= cached // 2
    assert found >= len(prompts) * 32  # every prompt found the system prompt's two full blocks
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, 24)
