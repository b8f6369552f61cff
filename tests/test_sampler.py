"""Sampling: greedy is argmax; seeded draws depend only on (seed, position)."""

from __future__ import annotations

import torch

from pat_engine.sampling.sampler import SamplingSpec, sample, uniform_for


def test_uniform_is_a_pure_function_of_seed_and_position():
    assert uniform_for(3, 10) == uniform_for(3, 10)
    draws = [uniform_for(3, p) for p in range(2000)]
    assert len(set(draws)) == 2000 and all(0 <= u < 1 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.03


def test_greedy_top_k_and_top_p():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]], dtype=torch.float64)
    greedy = SamplingSpec(0.0, -1, 1.0, 0, False)
    assert sample(logits, [greedy], [0])[0] == [1]
    top1 = SamplingSpec(1.0, 1, 1.0, 5, True)
    tokens, logprobs = sample(logits, [top1], [7])
    assert tokens == [1] and abs(logprobs[0] - torch.log_softmax(logits, -1)[0, 1].item()) < 1e-12
    # top_p small enough keeps only the most likely token
    assert all(sample(logits, [SamplingSpec(1.0, -1, 0.1, s, False)], [0])[0] == [1] for s in range(20))
    # with no filtering, many seeds visit several tokens, each within the support
    seen = {sample(logits, [SamplingSpec(1.0, -1, 1.0, s, False)], [0])[0][0] for s in range(200)}
    assert seen == {0, 1, 2, 3}


def test_suppressed_tokens_are_never_drawn():
    logits = torch.tensor([[0.0, 9.0, 1.0]], dtype=torch.float64)
    tokens, _ = sample(logits, [SamplingSpec(0.0, -1, 1.0, 0, False)], [0], [(1,)])
    assert tokens == [2]


def test_processed_logprobs_are_under_the_sampled_distribution():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]], dtype=torch.float64)
    raw_spec = SamplingSpec(0.5, 2, 1.0, 3, True)
    processed_spec = SamplingSpec(0.5, 2, 1.0, 3, True, processed_logprobs=True)
    (tok,), (raw,) = sample(logits, [raw_spec], [4])
    (tok2,), (processed,) = sample(logits, [processed_spec], [4])
    assert tok == tok2 and tok in (1, 3)
    assert abs(raw - torch.log_softmax(logits, -1)[0, tok].item()) < 1e-12
    kept = torch.softmax(logits[0, [1, 3]] / 0.5, -1)  # top-2 after temperature, renormalised
    assert abs(processed - torch.log(kept[0 if tok == 1 else 1]).item()) < 1e-12
