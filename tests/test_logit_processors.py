"""Logit bias, penalties and min_p equal transformers' logits processors (float64, exact)."""

from __future__ import annotations

import math

import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from pat_engine.sampling.inverse_cdf import weights
from pat_engine.sampling.processors import ProcessorRows

VOCAB = 50


def _histories(g: torch.Generator, rows: int) -> list[list[int]]:
    return [torch.randint(0, VOCAB, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(rows)]


def test_repetition_penalty_and_bias_equal_transformers():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=g, dtype=torch.float64) * 4
    hist = _histories(g, 4)
    bias = ((3, 2.5), (7, -1.0))
    procs = ProcessorRows.build([0, 1, 2, 3], [1.3] * 4, [0.0] * 4, [0.0] * 4, hist, [0] * 4, [bias] * 4, VOCAB)
    got = procs.apply(logits)
    for i in range(4):
        ids = torch.tensor([hist[i]])
        ref = SequenceBiasLogitsProcessor({(t,): b for t, b in bias})(ids, logits[i : i + 1].clone())
        ref = RepetitionPenaltyLogitsProcessor(1.3)(ids, ref)
        assert torch.equal(got[i], ref[0])


def test_frequency_and_presence_count_output_tokens_only():
    logits = torch.zeros(1, VOCAB, dtype=torch.float64)
    history = [5, 5, 9, 5, 9, 11]  # prompt [5, 5]; output [9, 5, 9, 11]
    procs = ProcessorRows.build([0], [1.0], [0.5], [0.25], [history], [2], [()], VOCAB)
    out = procs.apply(logits)[0]
    assert out[9].item() == -(0.5 * 2 + 0.25) and out[5].item() == -(0.5 + 0.25) and out[11].item() == -0.75
    assert out[0].item() == 0.0 and (out != 0).sum().item() == 3


def test_rows_without_processors_are_untouched():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=g, dtype=torch.float64)
    procs = ProcessorRows.build([1], [2.0], [0.0], [0.0], [[1, 2, 3]], [0], [()], VOCAB)
    out = procs.apply(logits)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2]) and not torch.equal(out[1], logits[1])


def test_min_p_keeps_what_transformers_keeps():
    g = torch.Generator().manual_seed(2)
    for trial in range(20):
        logits = torch.randn(1, VOCAB, generator=g, dtype=torch.float64) * 3
        temperature, min_p = [0.7, 1.0, 1.5][trial % 3], [0.05, 0.2, 0.6, 1.0][trial % 4]
        scaled = TemperatureLogitsWarper(temperature)(None, logits.clone())
        ref = MinPLogitsWarper(min_p)(None, scaled.clone())
        # the sampler keeps a token when its logit after the temperature is within log(min_p) of the best
        inv_temp = torch.tensor([1.0 / temperature], dtype=torch.float64).float()
        floor = torch.tensor([math.log(min_p)], dtype=torch.float64).float()
        e, _ = weights(logits, inv_temp, floor)
        assert torch.equal(e[0] > 0, torch.isfinite(ref[0]))
