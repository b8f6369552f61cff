"""Speculation on equals speculation off, token for token and log-prob for log-prob, on a real model.

Fast tier: the driver over in-process TP1 executors (tests/local_workers.py), two DP groups,
n=2 samples per prompt, prefix caching on, block invariants checked after every tick. Random
weights rarely repeat themselves, so acceptances are forced with an oracle proposer that
drafts the speculation-off run's tokens, some of them corrupted (right drafts are accepted,
wrong ones must change nothing); a proposer that is always wrong and the n-gram proposer
must change nothing either. Bitwise under ``numerics="invariant"`` (float32, bfloat16);
float64 in the fast numerics: tokens equal, log-probs to 1e-12 (a verify step's multi-token
GEMMs round its last bits differently, as any two float64 batch shapes do).
"""

from __future__ import annotations

import pytest

from local_workers import local_driver
from spec_helpers import ReplayProposer
from pat_engine.sampling.params import SamplingParams
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model

PROMPTS = [[5, 6, 7, 8] * 3, [100, 20, 30], [9, 9, 9, 9, 9, 9, 9], [5, 6, 7, 8] * 3 + [11]]  # the last shares blocks
MAX_NEW = [20, 12, 22, 10]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("spec"), TinyModelSpec(arch="qwen2", seed=5)))


def _params(sampled: bool, **extra) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=m, temperature=1.0 if sampled else 0.0, seed=40 + i, n=2, logprobs=True,
                           ignore_eos=True, **extra) for i, m in enumerate(MAX_NEW)]


def _run(path: str, params, proposer=None, speculate: bool = True, **config) -> dict:
    spec = {"max_active": 64, "adaptive": False} if speculate else None  # every proposal verified whole
    d = local_driver(path, dp=2, speculative=spec, **config)
    if proposer is not None:
        d.coord.stepping.set_draft_proposer(proposer)
    families = d.generate(PROMPTS, params)
    out = {(tuple(s.prompt_ids), s.sample_index): (s.output_ids, s.logprobs, s.top_logprobs)
           for f in families for s in f}
    if speculate:
        out["stats"] = d.coord.stepping.speculation_stats()
    return out


def _check(path: str, params, config: dict, bitwise: bool) -> None:
    ref = _run(path, params, speculate=False, **config)
    tokens = {k: v[0] for k, v in ref.items()}
    for wrong in (0.25, 1.0):
        got = _run(path, params, ReplayProposer(tokens, wrong, seed=3), **config)
        stats = got.pop("stats")
        assert stats["drafted_tokens"] > 0 and (stats["accepted_tokens"] > 0) == (wrong < 1.0)
        for key, (toks, lps, tops) in ref.items():
            assert got[key][0] == toks, f"wrong={wrong}: tokens of {key} differ"
            if bitwise:
                assert got[key][1] == lps and got[key][2] == tops, f"wrong={wrong}: log-probs of {key} differ"
            else:
                assert got[key][1] == pytest.approx(lps, abs=1e-12, rel=0)


@pytest.mark.parametrize("sampled", [False, True])
def test_invariant_float32_bitwise(tiny, sampled):
    _check(tiny, _params(sampled), {"dtype": "float32", "numerics": "invariant"}, bitwise=True)


def test_invariant_bfloat16_bitwise_with_processors_and_top_logprobs(tiny):
    params = _params(True, top_k=50, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1,
                     logit_bias=((7, 2.0),), top_logprobs=3)
    _check(tiny, params, {"dtype": "bfloat16", "numerics": "invariant"}, bitwise=True)


def test_float64_tokens_equal_and_logprobs_to_1e12(tiny):
    _check(tiny, _params(True), {"dtype": "float64"}, bitwise=False)


def test_the_ngram_proposer_changes_nothing(tiny):
    """The n-gram proposer, its history on: a second batch of the same prompts (an RL step's next
    iteration) drafts from the first batch's responses; both batches equal speculation off."""
    params = _params(True)
    ref = _run(tiny, params, speculate=False, dtype="float32", numerics="invariant")
    d = local_driver(tiny, dp=2, speculative={"max_active": 64, "history": True, "adaptive": False}, dtype="float32",
                     numerics="invariant")
    for _ in range(2):
        families = d.generate(PROMPTS, params)
        got = {(tuple(s.prompt_ids), s.sample_index): (s.output_ids, s.logprobs, s.top_logprobs)
               for f in families for s in f}
        assert got == ref
    stats = d.coord.stepping.speculation_stats()
    assert stats["accepted_tokens"] >= sum(MAX_NEW) and stats["tokens_per_step"] > 2
