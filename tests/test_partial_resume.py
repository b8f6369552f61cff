"""Exact partial-rollout resume: abort after k tokens, resubmit prompt + those k tokens with the same seed and
max_new_tokens - k, and the concatenation is exactly the uninterrupted output; with a live switch while the
request runs and another between the abort and the resubmission, under both KV paths (float64).

The convention this proves (docs/pat-serve.md): a draw depends only on (seed, absolute position), the
position counted from the first prompt token, so the resubmitted request draws at the same positions.
"""

from __future__ import annotations

import time

import pytest

from conftest import hf_greedy
from pat_engine import Engine, SamplingParams

pytestmark = pytest.mark.slow  # starts worker processes

PROMPT = [100, 20, 30, 40, 50, 60, 70]
TOTAL = 40


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float64", max_model_len=256) as eng:
        yield eng


def _wait_generated(handle, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while handle.num_generated < n and not handle.done():
        assert time.monotonic() < deadline, "the request did not reach the wanted length"
        time.sleep(0.005)


@pytest.mark.parametrize("kv_transfer", ["migrate", "recompute"])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234)],
                         ids=["greedy", "seeded"])
def test_abort_switch_resume_equals_uninterrupted(engine, model_dir, kv_transfer, sampling):
    params = SamplingParams(max_new_tokens=TOTAL, ignore_eos=True, **sampling)
    whole = engine.generate([PROMPT], params, use_tqdm=False)[0].token_ids
    if sampling["temperature"] == 0.0:
        assert whole == hf_greedy(model_dir("llama"), PROMPT, TOTAL)  # the reference itself is right

    handle = engine.submit(PROMPT, params)
    _wait_generated(handle, 4)
    event = engine.reconfigure(2, kv_transfer=kv_transfer)  # live switch while the request runs
    assert event.kv_path == kv_transfer
    _wait_generated(handle, 9)
    engine.pause()  # hold it between steps, so the abort lands before the request could finish
    engine.abort([handle.request_id])
    engine.resume()
    handle.wait(30)
    partial = handle.output()
    assert partial.finish_reason == "abort"
    k = len(partial.token_ids)
    assert 9 <= k < TOTAL, k
    engine.reconfigure(1, kv_transfer=kv_transfer)  # and another between the abort and the resubmission

    rest = engine.generate([PROMPT + partial.token_ids],
                           SamplingParams(max_new_tokens=TOTAL - k, ignore_eos=True, **sampling), use_tqdm=False)[0]
    assert partial.token_ids + rest.token_ids == whole
