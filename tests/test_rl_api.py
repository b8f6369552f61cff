"""The engine APIs an RL loop needs: weight sync, sleep/wake, abort, pause/resume.

2 worker processes, float64. Updated weights must give exactly what a fresh
engine loaded from the updated checkpoint gives, whatever layout the update
landed in; sleep must really give memory back (worker RSS) and generation
must continue identically after wake-up. Also: the async frontend every RL
adapter serves through, and the GRPO example's loop.
"""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common import rss_bytes
from conftest import MAX_NEW, PROMPTS
from pat_engine import Engine, InvalidRequestError, ModelLoadError, SamplingParams
from pat_integrations.frontend import AsyncEngineFrontend
from pat_integrations.stage import StagePlan
from rl_helpers import fresh_tensors, perturbed_checkpoint
from waiting import generated_counts, wait_for, wait_for_async

pytestmark = pytest.mark.slow  # starts worker processes

KV_BYTES = 96 << 20  # per rank: large enough that releasing it shows in RSS
GREEDY = [SamplingParams(max_new_tokens=m, logprobs=True) for m in MAX_NEW]
SAMPLED = [SamplingParams(max_new_tokens=m, temperature=0.9, top_k=40, seed=7 + i, logprobs=True)
           for i, m in enumerate(MAX_NEW)]


def tokens(outs):
    return [o.token_ids for o in outs]


def reference(path: str, params=GREEDY):
    with Engine(path, tp=1, dp=2, dtype="float64") as fresh:
        return fresh.generate(PROMPTS, params, use_tqdm=False)


def rss_kib(pid: int) -> int:
    return rss_bytes(pid) // 1024


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float64", kv_cache_bytes=KV_BYTES) as e:
        yield e


@pytest.fixture(scope="module")
def updated(model_dir, tmp_path_factory):
    """Two successive "trainer steps" away from the served checkpoint."""
    base = model_dir("llama")
    root = tmp_path_factory.mktemp("updates")
    return perturbed_checkpoint(base, root / "step1", seed=1), perturbed_checkpoint(base, root / "step2", seed=2)


def test_update_weights_equals_fresh_engine_in_base_and_switched_layouts(engine, model_dir, updated):
    step1, step2 = updated
    before = tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False))

    # base layout TP1xDP2, small buckets so the update streams in many pieces
    n = engine.update_weights(fresh_tensors(step1), bucket_bytes=64 << 10)
    assert n == len(load_file(str(Path(step1) / "model.safetensors")))
    got = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    want = reference(step1)
    assert tokens(got) == tokens(want) and tokens(got) != before
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-9)

    # the update lands while the engine sits in the switched layout TP2xDP1; the next stage
    # starts from the base layout (resharding the new weights) and switches back mid-batch
    engine.reconfigure(tp=2)
    engine.update_weights(fresh_tensors(step2))
    seen = len(engine.switches)
    got = engine.generate(PROMPTS, SAMPLED, from_base_layout=True, switch_schedule=[(5, 2)], use_tqdm=False)
    events = engine.switches[seen:]
    assert [e.to_layout for e in events] == ["TP1xDP2", "TP2xDP1"] and all(e.ok for e in events)
    want = reference(step2, SAMPLED)
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-9)

    engine.update_weights_from_disk(model_dir("llama"))  # back to the served checkpoint for later tests
    assert tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == before


def test_update_weights_streams_instead_of_holding_the_model(engine, model_dir):
    """With small buckets, few of the yielded tensors are alive at once: the model is never held twice."""
    alive: list[weakref.ref] = []
    peak = 0

    def tracked():
        nonlocal peak
        for name, tensor in fresh_tensors(model_dir("llama")):
            gc.collect()
            peak = max(peak, sum(r() is not None for r in alive))
            alive.append(weakref.ref(tensor))
            yield name, tensor

    total = engine.update_weights(tracked(), bucket_bytes=1)  # one tensor per bucket
    assert total > 10 and peak <= 2, f"{peak} of {total} tensors alive at once"


def test_bad_weight_updates_are_refused_before_anything_changes(engine, model_dir, tmp_path):
    before = tokens(engine.generate(PROMPTS[:2], GREEDY[:2], use_tqdm=False))
    good = next(fresh_tensors(model_dir("llama")))
    with pytest.raises(ModelLoadError, match="shape"):
        engine.update_weights([good, ("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))])
    with pytest.raises(ModelLoadError, match="unknown weight"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(3, 3))])
    other = tmp_path / "other"
    from pat_engine.tiny_model import TinyModelSpec, write_tiny_model

    write_tiny_model(other, TinyModelSpec(hidden_size=64))
    with pytest.raises(ModelLoadError, match="different model"):
        engine.update_weights_from_disk(str(other))
    assert tokens(engine.generate(PROMPTS[:2], GREEDY[:2], use_tqdm=False)) == before


def test_update_weights_from_disk_equals_fresh_engine(engine, model_dir, updated):
    step1, _ = updated
    engine.update_weights_from_disk(step1)
    try:
        assert tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(reference(step1))
    finally:
        engine.update_weights_from_disk(model_dir("llama"))


def test_sleep_frees_worker_memory_and_wake_up_restores_identical_generation(engine, model_dir, updated):
    pids = engine.worker_pids()
    before = engine.generate(PROMPTS, SAMPLED, use_tqdm=False)
    awake = [rss_kib(p) for p in pids]

    freed = engine.sleep(level=1)
    asleep = [rss_kib(p) for p in pids]
    assert freed >= 2 * KV_BYTES
    for a, s in zip(awake, asleep):  # each rank gave back (nearly) its whole KV pool
        assert a - s >= 0.8 * KV_BYTES / 1024, f"RSS only fell from {a} to {s} KiB"
    with pytest.raises(InvalidRequestError, match="asleep"):
        engine.generate(PROMPTS[:1], GREEDY[:1], use_tqdm=False)

    engine.wake_up()
    assert all(rss_kib(p) >= s + 0.8 * KV_BYTES / 1024 for p, s in zip(pids, asleep))
    after = engine.generate(PROMPTS, SAMPLED, use_tqdm=False)
    assert tokens(after) == tokens(before) and [o.logprobs for o in after] == [o.logprobs for o in before]

    # level 2 drops the weights too: they come back from disk ...
    engine.sleep(level=2)
    engine.wake_up()
    assert tokens(engine.generate(PROMPTS, SAMPLED, use_tqdm=False)) == tokens(before)

    # ... unless they only lived in memory: then generation waits for the trainer's next push
    step1, _ = updated
    engine.update_weights(fresh_tensors(step1))
    engine.sleep(level=2)
    engine.wake_up(tags=["weights"])
    engine.wake_up(tags=["kv_cache"])
    with pytest.raises(InvalidRequestError, match="not current"):
        engine.generate(PROMPTS[:1], GREEDY[:1], use_tqdm=False)
    engine.update_weights(fresh_tensors(step1))
    assert tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(reference(step1))
    engine.update_weights_from_disk(model_dir("llama"))


def test_abort_returns_partial_output_with_clear_reason(engine):
    full = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=300, ignore_eos=True), use_tqdm=False)[0]
    long = engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=300, ignore_eos=True, logprobs=True), "long")
    short = engine.submit(PROMPTS[1], GREEDY[1], "short")
    wait_for(lambda: long.num_generated >= 5)
    assert engine.num_unfinished_requests() >= 1
    assert engine.abort(["long", "no-such-request"]) == 1
    assert long.wait(30) and short.wait(60)
    out = long.output()
    assert out.finish_reason == "abort" and "aborted" in out.error
    assert 5 <= len(out.token_ids) < 300 and out.token_ids == full.token_ids[: len(out.token_ids)]
    assert len(out.logprobs) == len(out.token_ids)
    assert out.prompt_token_ids == PROMPTS[0]  # prompt/response boundary kept
    assert short.output().finish_reason in ("stop", "length")
    assert engine.num_unfinished_requests() == 0


def test_pause_holds_requests_and_resume_continues_them(engine):
    want = engine.generate([PROMPTS[2]], GREEDY[2], use_tqdm=False)[0].token_ids
    engine.pause()
    try:
        handle = engine.submit(PROMPTS[2], GREEDY[2], "paused")
        time.sleep(1.0)
        assert handle.num_generated == 0 and engine.num_unfinished_requests() == 1
    finally:
        engine.resume()
    assert handle.wait(60) and handle.output().token_ids == want
    assert engine.flush_cache() is True


def test_grpo_example_pushes_weights_every_step(tmp_path):
    """The example's loop, 3 iterations: each rollout switches live, and its logprobs match the trainer's
    freshly updated policy (without ``update_weights`` they drift by ~10 nats after one step)."""
    import dataclasses
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "examples" / "grpo_tiny.py"
    spec = importlib.util.spec_from_file_location("grpo_tiny", path)
    grpo = importlib.util.module_from_spec(spec)
    sys.modules["grpo_tiny"] = grpo  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(grpo)
    finally:
        del sys.modules["grpo_tiny"]
    rows = grpo.run(dataclasses.replace(grpo.GRPOConfig(), iterations=3), tmp_path)
    assert all(r["switches"] == "TP1xDP2->TP2xDP1" and r["tensors"] > 0 for r in rows)
    assert all(r["logprob_drift"] < 1e-3 for r in rows), [r["logprob_drift"] for r in rows]


def test_async_frontend_stages_gate_and_bad_batches(engine):
    """The layer every RL adapter serves through (no Ray needed): stages, gate, withdrawal, wake-up guard."""
    long = SamplingParams(max_new_tokens=300, ignore_eos=True)
    want = engine.generate(PROMPTS[:2], GREEDY[:2], use_tqdm=False)

    async def scenario():
        fe = AsyncEngineFrontend(engine)
        engine.reconfigure(tp=2)  # left over from an earlier stage
        seen = len(engine.switches)
        outs = await fe.generate_batch(PROMPTS[:2], GREEDY[:2], plan=StagePlan.from_options([(3, 2)]))
        stage = ([e.to_layout for e in engine.switches[seen:]], list(fe.stages.layouts_at_start))

        with pytest.raises(InvalidRequestError):  # the bad second prompt withdraws the first
            await fe.generate_batch([PROMPTS[0], [10 ** 6]], GREEDY[:2])
        withdrawn = (fe.num_in_flight, engine.num_unfinished_requests())

        running = asyncio.ensure_future(fe.generate(PROMPTS[0], long))
        # gate on state, not wall time: the request has produced tokens, then is held where it is
        await wait_for_async(lambda: fe.num_in_flight and max(generated_counts(engine), default=0) >= 5)
        await fe.call(engine.pause, "in_place")
        try:
            await fe.wake_up()  # awake already: must not touch the KV cache of the running request
            aborted_ids = await fe.abort_all(reject=True)
        finally:
            await fe.call(engine.resume)
        aborted = await running
        rejected = await fe.generate(PROMPTS[1], GREEDY[1])
        fe.reopen()
        again = await fe.generate(PROMPTS[1], GREEDY[1])
        return outs, stage, withdrawn, aborted_ids, aborted, rejected, again

    outs, stage, withdrawn, aborted_ids, aborted, rejected, again = asyncio.run(scenario())
    assert tokens(outs) == tokens(want)
    assert stage == (["TP1xDP2", "TP2xDP1"], ["TP1xDP2"])
    assert withdrawn == (0, 0)
    assert len(aborted_ids) == 1 and aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 300
    full = engine.generate([PROMPTS[0]], long, use_tqdm=False)[0].token_ids
    assert aborted.token_ids == full[: len(aborted.token_ids)]
    assert rejected is None and again.token_ids == want[1].token_ids
