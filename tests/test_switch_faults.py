"""A failure during a switch never hangs and never loses a request.

With recovery on (default) the world is rebuilt and the batch completes with
the same tokens; with recovery off every request comes back with finish
reason "error", its partial tokens and a message naming the failed rank.
"""

from __future__ import annotations

import threading
import time

import pytest

from conftest import MAX_NEW, PROMPTS, hf_greedy_batch
from pat_engine import Engine, SamplingParams, WorkerFailure
from fault_injection import FAULT_WORKER, inject_fault

pytestmark = pytest.mark.slow  # starts worker processes

GREEDY = [SamplingParams(max_new_tokens=m) for m in MAX_NEW]


def inject(engine, rank, where, how):
    inject_fault(engine, [rank], where, how)


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine(model_dir("llama"), tp=1, dp=4, dtype="float64", max_worker_restarts=10,
                worker_class=FAULT_WORKER) as eng:
        yield eng


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_failure_inside_reshard_recovers_with_identical_tokens(engine, model_dir, how):
    engine.reconfigure(tp=2)
    inject(engine, 2, "reshard", how)
    outs = engine.generate(PROMPTS, GREEDY, switch_schedule=[(5, 4)], use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy_batch(model_dir("llama"))
    failed = [e for e in engine.switches if not e.ok]
    assert failed and "rank 2" in failed[-1].error
    assert engine.layout.tp == 1  # rebuilt at the base layout


def test_failure_without_recovery_returns_every_request_with_a_reason(model_dir):
    with Engine(model_dir("llama"), tp=1, dp=4, dtype="float64", recover_failed_workers=False,
                worker_class=FAULT_WORKER) as engine:
        inject(engine, 3, "reshard", "exit")
        with pytest.raises(WorkerFailure, match="rank 3") as info:
            engine.generate(PROMPTS, GREEDY, switch_schedule=[(6, 4)], use_tqdm=False)
        partial = info.value.partial_outputs
        assert len(partial) == len(PROMPTS)
        expected = hf_greedy_batch(model_dir("llama"))
        for out, exp in zip(partial, expected):
            assert out.finish_reason in ("error", "stop", "length")
            assert out.token_ids == exp[: len(out.token_ids)]  # what it got before the failure is right
        assert any(o.finish_reason == "error" and "rank 3" in o.error for o in partial)
        # and the engine keeps serving
        again = engine.generate(PROMPTS[:2], GREEDY[:2], use_tqdm=False)
        assert [o.token_ids for o in again] == expected[:2]


def test_reconfigure_from_another_thread_mid_batch(engine, model_dir):
    engine.reconfigure(tp=1)
    before = len(engine.switches)
    result = {}

    def switch_when_started():
        coord = engine.coordinator
        while not (coord.stepping.seqs and coord.stepping.stage_decode_steps >= 3):  # this batch is decoding
            time.sleep(0.002)
        result["event"] = engine.reconfigure(tp=4, kv_transfer="migrate")

    t = threading.Thread(target=switch_when_started)
    t.start()
    outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    t.join(60)
    assert [o.token_ids for o in outs] == hf_greedy_batch(model_dir("llama"))
    event = result["event"]
    assert event.ok and event.to_layout == "TP4xDP1" and event.costs["migrated_requests"] > 0
    assert engine.switches[before:] == [event]


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_reconfigure_that_fails_mid_batch_loses_no_request(engine, model_dir, how):
    """reconfigure() from another thread whose switch fails on a worker: the caller gets the failure, and
    the batch, whose requests the switch had already taken out of their queues, is recovered and completes
    with the same tokens (before, the failure stopped at the caller and generate() waited forever)."""
    engine.reconfigure(tp=1)
    inject(engine, 1, "reshard", how)
    outcome: dict = {}

    def switch_when_started():
        stepping = engine.coordinator.stepping
        while not (stepping.seqs and stepping.stage_decode_steps >= 3):
            time.sleep(0.002)
        try:
            engine.reconfigure(tp=2, kv_transfer="migrate")
        except WorkerFailure as exc:
            outcome["error"] = str(exc)

    def generate():
        outcome["outs"] = engine.generate(PROMPTS, GREEDY, use_tqdm=False)

    switcher, generator = threading.Thread(target=switch_when_started), threading.Thread(target=generate)
    switcher.start()
    generator.start()
    switcher.join(120)
    generator.join(120)
    assert not generator.is_alive(), "generate() never returned after the failed switch"
    assert "rank 1" in outcome["error"]
    assert [o.token_ids for o in outcome["outs"]] == hf_greedy_batch(model_dir("llama"))
