"""Nothing an RL loop does to memory may change a token: sleep / wake_up cycles, redundant wake-ups
and pause modes around them, with real worker processes (TP1xDP2, float64: any changed token is
corruption, not rounding).

Prompts repeat, so later requests are served from the prefix cache: a cache entry that outlived
the KV memory it pointed to shows up as wrong tokens. The default-sized (lazily committed) CPU KV
pool is used, as ``pat-serve`` runs it.
"""

from __future__ import annotations

import time

import pytest

from conftest import PROMPTS
from pat_engine import Engine, InvalidRequestError, SamplingParams
from waiting import wait_for

pytestmark = pytest.mark.slow  # starts worker processes

LONG = [p * 6 for p in PROMPTS]  # several full KV blocks each: prefix-cache hits on repeats
PARAMS = [SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=True),
          SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, seed=11, logprobs=True)] * 3
RUNNING = SamplingParams(max_new_tokens=160, ignore_eos=True, temperature=0.8, seed=5)


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float64") as e:
        yield e


@pytest.fixture(scope="module")
def reference(engine):
    """What a fresh engine gives (this engine before any memory was released)."""
    outs = engine.generate(LONG, PARAMS, use_tqdm=False)
    running = engine.generate([PROMPTS[3]], RUNNING, use_tqdm=False)[0]
    return [(o.token_ids, o.logprobs) for o in outs], running.token_ids


@pytest.fixture(autouse=True)
def _awake(engine):
    yield
    engine.wake_up()
    engine.resume()
    engine.abort_all()


def same_as_reference(engine, reference) -> None:
    for _ in range(2):  # the second round is served from the prefix cache the first one filled
        outs = engine.generate(LONG, PARAMS, use_tqdm=False)
        assert [(o.token_ids, o.logprobs) for o in outs] == reference[0]
    assert engine.kv_blocks()["invariants"] == "ok"


def test_waking_an_awake_engine_changes_nothing(engine, reference):
    assert engine.prefix_cache_stats()["cached_blocks"] > 0
    assert engine.wake_up() == []  # nothing was released
    same_as_reference(engine, reference)
    handle = engine.submit(PROMPTS[3], RUNNING)
    wait_for(lambda: handle.num_generated >= 10)
    engine.wake_up()  # a client retrying /resume_memory_occupation under a running request
    engine.wake_up(["kv_cache"])
    assert handle.wait(120) and handle.output().token_ids == reference[1]


@pytest.mark.parametrize("release, restore", [
    ({"level": 1}, [None]),
    ({"level": 2}, [None]),
    ({"tags": ["kv_cache"]}, [["kv_cache"]]),
    ({"tags": ["weights"]}, [["weights"]]),
    ({"tags": None}, [["weights"], ["kv_cache"], None]),  # SGLang: release all, resume by tag, retry
], ids=["level1", "level2", "kv_cache", "weights", "all-by-tag"])
def test_release_resume_cycle_then_cached_prompts_equal_a_fresh_engine(engine, reference, release, restore):
    for _ in range(2):
        engine.pause("abort")
        freed = engine.sleep(release.get("level", 1), release.get("tags", ["weights", "kv_cache", "cuda_graph"])
                             if "tags" in release else None)
        assert freed > 0 and engine.sleeping
        with pytest.raises(InvalidRequestError, match="asleep"):
            engine.generate(LONG[:1], PARAMS[:1], use_tqdm=False)
        for tags in restore:
            engine.wake_up(tags)
        assert not engine.sleeping
        engine.resume()
        same_as_reference(engine, reference)


def test_sleep_under_a_paused_running_request_recomputes_it_exactly(engine, reference):
    handle = engine.submit(PROMPTS[3], RUNNING)
    wait_for(lambda: handle.num_generated >= 10)
    engine.pause("in_place")
    engine.sleep(2)  # its KV goes; it waits to be prefilled again
    queued = engine.kv_blocks()
    assert queued["unfinished"] == 1 and all(g["free"] == g["total"] for g in queued["groups"])
    time.sleep(0.3)
    engine.wake_up(["weights"])
    assert not handle.done()  # the KV is still released: nothing runs
    engine.wake_up(["kv_cache"])
    assert not handle.done()  # still paused
    engine.resume()
    assert handle.wait(120) and handle.output().token_ids == reference[1]
    assert handle.output().metrics["preemptions"] == 1
    same_as_reference(engine, reference)


def test_requests_queued_while_paused_wait_through_the_release(engine, reference):
    engine.pause("abort")
    handles = [engine.submit(p, sp) for p, sp in zip(LONG, PARAMS)]  # arrive between pause and release
    engine.sleep(1)
    engine.wake_up()
    engine.wake_up()
    engine.resume()
    assert all(h.wait(120) for h in handles)
    assert [(h.output().token_ids, h.output().logprobs) for h in handles] == reference[0]


def test_weight_updates_are_refused_while_the_weights_are_released(engine, reference, model_dir):
    engine.sleep(2)
    with pytest.raises(InvalidRequestError, match="released"):
        engine.update_weights_from_disk(model_dir("llama"))
    engine.wake_up(["weights"])
    engine.update_weights_from_disk(model_dir("llama"))
    engine.wake_up(["kv_cache"])
    same_as_reference(engine, reference)
