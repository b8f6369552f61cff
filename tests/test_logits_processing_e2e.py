"""Penalties, min_p, logit bias and prompt log-probs through the engine equal transformers (float64).

Greedy tokens equal ``transformers.generate`` with the same processors; processed log-probs equal
transformers' processors applied to the model's float64 logits within 1e-9; prompt log-probs
(echo) equal its log-softmax of the prompt within 1e-9. Run under a TP2 layout and across a switch.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from conftest import _hf_model
from pat_engine import Engine, SamplingParams

pytestmark = pytest.mark.slow  # starts worker processes

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 20, 30, 40, 50, 60, 70, 80, 90, 7, 7, 7]]
BIAS = ((17, 3.0), (31, -2.0))


def hf_logits(path: str, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return _hf_model(path)(torch.tensor([tokens])).logits[0].to(torch.float64)  # (len, vocab)


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine(model_dir("llama"), tp=2, dp=1, dtype="float64") as eng:
        yield eng


def test_greedy_repetition_penalty_and_bias_equal_transformers(engine, model_dir):
    path = model_dir("llama")
    params = SamplingParams(max_new_tokens=16, repetition_penalty=1.4, logit_bias=BIAS, logprobs=True,
                            logprobs_mode="processed")
    outs = engine.generate(PROMPTS, params, use_tqdm=False, switch_schedule=[(5, 1)])
    model = _hf_model(path)
    for prompt, out in zip(PROMPTS, outs):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=1.4,
                             sequence_bias={(t,): b for t, b in BIAS})
        assert out.token_ids == ref[0, len(prompt):].tolist()
        full = prompt + out.token_ids
        logits = hf_logits(path, full)
        for i, lp in enumerate(out.logprobs):
            pos = len(prompt) + i - 1
            ids = torch.tensor([full[: pos + 1]])
            scores = SequenceBiasLogitsProcessor({(t,): b for t, b in BIAS})(ids, logits[pos : pos + 1].clone())
            scores = RepetitionPenaltyLogitsProcessor(1.4)(ids, scores)
            assert lp == pytest.approx(torch.log_softmax(scores, -1)[0, full[pos + 1]].item(), abs=1e-9)


def test_sampled_min_p_logprobs_equal_transformers_warpers(engine, model_dir):
    path = model_dir("llama")
    params = SamplingParams(max_new_tokens=12, temperature=0.8, min_p=0.1, seed=3, logprobs=True,
                            logprobs_mode="processed")
    out = engine.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    full = PROMPTS[0] + out.token_ids
    logits = hf_logits(path, full)
    for i, lp in enumerate(out.logprobs):
        pos = len(PROMPTS[0]) + i - 1
        scores = MinPLogitsWarper(0.1)(None, TemperatureLogitsWarper(0.8)(None, logits[pos : pos + 1].clone()))
        ref = torch.log_softmax(scores, -1)[0, full[pos + 1]].item()
        assert ref > float("-inf") and lp == pytest.approx(ref, abs=1e-9)


def test_frequency_and_presence_penalties_follow_openai(engine, model_dir):
    path = model_dir("llama")
    params = SamplingParams(max_new_tokens=14, frequency_penalty=0.7, presence_penalty=0.4, logprobs=True,
                            logprobs_mode="processed")
    out = engine.generate(PROMPTS[1:], params, use_tqdm=False)[0]
    prompt = PROMPTS[1]
    full = prompt + out.token_ids
    logits = hf_logits(path, full)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        pos = len(prompt) + i - 1
        counts = torch.bincount(torch.tensor(out.token_ids[:i], dtype=torch.long), minlength=logits.shape[-1])
        scores = logits[pos] - 0.7 * counts - 0.4 * (counts > 0).to(torch.float64)
        assert tok == int(scores.argmax()) and lp == pytest.approx(torch.log_softmax(scores, -1)[tok].item(), abs=1e-9)


def test_prompt_logprobs_equal_transformers_log_softmax(engine, model_dir):
    path = model_dir("llama")
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=2, prompt_logprobs=3), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        lp = torch.log_softmax(hf_logits(path, prompt), -1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for j in range(1, len(prompt)):
            assert out.prompt_logprobs[j] == pytest.approx(lp[j - 1, prompt[j]].item(), abs=1e-9)
            top = out.prompt_top_logprobs[j]
            assert [t for t, _ in top] == lp[j - 1].topk(3).indices.tolist()
