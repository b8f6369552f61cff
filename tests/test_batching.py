"""Continuous batching under scarce KV: preemption by recompute yields identical tokens."""

from __future__ import annotations

from conftest import MAX_NEW, PROMPTS, hf_greedy_batch
from pat_engine import Engine, SamplingParams
from pat_engine.core.memory import MemoryPlan
from pat_engine.model.arch import load_model_arch
from pat_engine.parallel.layout import Layout
import pytest

pytestmark = pytest.mark.slow  # starts worker processes


def test_scarce_kv_blocks_force_preemption_with_identical_tokens(model_dir):
    path = model_dir("llama")
    arch = load_model_arch(path)
    import torch

    block = MemoryPlan(arch, torch.float64, 16, 0, Layout(1, 1), False).block_bytes(Layout(1, 1))
    with Engine(path, tp=1, dp=1, dtype="float64", kv_cache_bytes=10 * block) as engine:
        outs = engine.generate(PROMPTS, [SamplingParams(max_new_tokens=m) for m in MAX_NEW], use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy_batch(path)
    assert sum(o.metrics["preemptions"] for o in outs) > 0, "the test should have forced preemption"


def test_stop_tokens_eos_and_min_tokens(model_dir):
    path = model_dir("llama")
    ref = hf_greedy_batch(path, [PROMPTS[0]], [30])[0]
    stop = ref[10]
    with Engine(path, tp=1, dp=1, dtype="float64") as engine:
        out = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=30, stop_token_ids=[stop]), use_tqdm=False)[0]
        assert out.finish_reason == "stop" and out.token_ids == ref[: ref.index(stop) + 1]
        out = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=5, logprobs=True), use_tqdm=False)[0]
        assert out.finish_reason == "length" and len(out.logprobs) == 5 and all(lp <= 0 for lp in out.logprobs)
        # the first token is suppressed until min_new_tokens, so the output changes
        first = ref[0]
        out = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=3, min_new_tokens=3, stop_token_ids=[first]),
                              use_tqdm=False)[0]
        assert out.token_ids[0] != first and len(out.token_ids) == 3
