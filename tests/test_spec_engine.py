"""Speculative decoding in the real engine (worker processes): speculation on equals off, in every
layout of a world of 2 (TP1xDP2, TP2xDP1), across live switches on both KV paths, greedy and seeded
sampling, n=2 samples per prompt, prefix caching on.

Acceptances are forced by replaying the speculation-off run's tokens as drafts, a share of them
corrupted (so both accepted and rejected drafts occur in every run). float64 (fast numerics):
tokens equal, log-probs to 1e-9 (the suite's float64 tolerance); bfloat16 under
``numerics="invariant"``: tokens and log-probs bit for bit.
"""

from __future__ import annotations

import pytest

from pat_engine import Engine, SamplingParams
from spec_helpers import ReplayProposer

pytestmark = pytest.mark.slow  # starts worker processes

SYSTEM = list(range(40, 58))  # shared by the first prompts: prefix-cache hits
PROMPTS = [SYSTEM + [100 + i, 7 * i + 3] for i in range(3)] + [[5, 6, 7], [300, 12, 13, 14, 15]]
MAX_NEW = [20, 9, 24, 17, 14]
RUNS = {  # name -> (starting TP, switch schedule, KV path)
    "TP1xDP2": (1, None, None),
    "TP2xDP1": (2, None, None),
    "switch TP1->TP2 migrate": (1, [(3, 2)], "migrate"),
    "switch TP2->TP1 recompute": (2, [(3, 1)], "recompute"),
}


def _params(sampled: bool) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=m, ignore_eos=True, logprobs=True, n=2, seed=31 + i,
                           temperature=1.0 if sampled else 0.0) for i, m in enumerate(MAX_NEW)]


def _run(engine: Engine, start_tp: int, sampled: bool, schedule=None, kv=None) -> dict:
    engine.reconfigure(tp=start_tp)
    outs = engine.generate(PROMPTS, _params(sampled), switch_schedule=schedule, kv_transfer=kv, use_tqdm=False)
    return {(tuple(s.prompt_token_ids), s.sample_index): (s.token_ids, s.logprobs) for o in outs for s in o.samples}


@pytest.mark.parametrize("dtype,numerics", [("float64", "fast"), ("bfloat16", "invariant")])
def test_speculation_on_equals_off_across_layouts_and_switches(model_dir, dtype, numerics):
    path = model_dir("llama")
    with Engine(path, tp=1, dp=2, dtype=dtype, numerics=numerics) as engine:
        reference = {sampled: _run(engine, 1, sampled) for sampled in (False, True)}
    with Engine(path, tp=1, dp=2, dtype=dtype, numerics=numerics,
                speculative={"max_active": 64, "adaptive": False}) as engine:
        for sampled in (False, True):
            ref = reference[sampled]
            engine.set_draft_proposer(ReplayProposer({k: v[0] for k, v in ref.items()}, wrong=0.25, seed=int(sampled)))
            for name, (tp, schedule, kv) in RUNS.items():
                before = engine.speculation_stats()
                got = _run(engine, tp, sampled, schedule, kv)
                after = engine.speculation_stats()
                assert after["accepted_tokens"] > before["accepted_tokens"], name
                assert after["drafted_tokens"] - before["drafted_tokens"] > after["accepted_tokens"] - before["accepted_tokens"]
                for key, (tokens, logprobs) in ref.items():
                    assert got[key][0] == tokens, f"{dtype} {name} sampled={sampled}: tokens of {key} differ"
                    if numerics == "invariant":
                        assert got[key][1] == logprobs, f"{dtype} {name} sampled={sampled}: log-probs of {key} differ"
                    else:
                        assert got[key][1] == pytest.approx(logprobs, abs=1e-9, rel=0)
            assert engine.kv_blocks()["invariants"] == "ok"
        assert len(engine.switches) >= 2 and all(e.ok for e in engine.switches)


def test_the_ngram_proposer_with_history_in_the_engine(model_dir):
    """The default proposer, history on: the same prompts again draft from the earlier responses."""
    path = model_dir("llama")
    with Engine(path, tp=1, dp=2, dtype="float64") as engine:
        ref = _run(engine, 1, True)
    with Engine(path, tp=1, dp=2, dtype="float64", speculative={"history": True, "max_active": 64,
                                                                "adaptive": False}) as engine:
        first = _run(engine, 1, True)
        second = _run(engine, 2, True, [(2, 1)], "migrate")
        stats = engine.speculation_stats()
    for got in (first, second):
        assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in ref.items()}
    assert stats["accepted_tokens"] >= sum(MAX_NEW)  # most of the second batch came from the first
