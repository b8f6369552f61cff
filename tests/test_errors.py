"""Bad input gets a clear error naming the problem, and the engine keeps serving."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import hf_greedy
from fault_injection import FAULT_WORKER, inject_fault
from pat_engine import Engine, InvalidRequestError, Layout, LayoutError, ModelLoadError, SamplingParams, WorkerFailure
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float64", max_model_len=64) as eng:
        yield eng


@pytest.mark.slow
def test_prompt_longer_than_context(engine):
    with pytest.raises(InvalidRequestError, match="context holds 64"):
        engine.generate([list(range(70))], SamplingParams(max_new_tokens=4), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="exceeds the context length"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=62), use_tqdm=False)


@pytest.mark.slow
def test_malformed_prompts_and_params(engine):
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        engine.generate([[]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        engine.generate([""], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.generate([[1, 99999]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="string or a list of token ids"):
        engine.generate([3.5], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="2 prompts but 3 sampling params"):
        engine.generate([[1], [2]], [SamplingParams()] * 3, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


@pytest.mark.slow
def test_bad_layout_targets_are_refused_and_nothing_moves(engine):
    with pytest.raises(LayoutError, match="does not divide the world size 2"):
        engine.reconfigure(tp=4)
    with pytest.raises(LayoutError, match="tp=3 does not divide"):
        engine.reconfigure(tp=3)
    with pytest.raises(LayoutError, match="power of two"):
        Layout.for_world(6, 3)
    assert str(engine.layout) == "TP1xDP2"


@pytest.mark.slow
def test_engine_still_serves_after_errors(engine, model_dir):
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8), use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(model_dir("llama"), [5, 6, 7], 8)
    out = engine.generate(["the answer is"], SamplingParams(max_new_tokens=4), use_tqdm=False)[0]
    assert out.text is not None and len(out.token_ids) == 4


def test_tp_that_does_not_divide_heads(tmp_path):
    path = write_tiny_model(tmp_path / "m", TinyModelSpec(num_heads=6, num_kv_heads=2, hidden_size=96, intermediate_size=192))
    with pytest.raises(LayoutError, match="does not divide num_attention_heads=6"):
        Engine(str(path), tp=4, dp=1)


def test_unknown_architecture_and_missing_files(tmp_path, model_dir):
    bad = tmp_path / "bad"
    shutil.copytree(model_dir("llama"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unknown architecture 'GPT2LMHeadModel'"):
        Engine(str(bad))
    with pytest.raises(ModelLoadError, match="no config.json"):
        Engine(str(tmp_path))
    empty = tmp_path / "noweights"
    shutil.copytree(model_dir("llama"), empty)
    os.remove(empty / "model.safetensors")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        Engine(str(empty))


@pytest.mark.slow
def test_shape_mismatch_is_a_load_error(tmp_path, model_dir):
    bad = tmp_path / "shape"
    shutil.copytree(model_dir("llama"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 512  # the checkpoint holds 256
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="checkpoint shape"):
        Engine(str(bad), tp=1, dp=1)


@pytest.mark.slow
def test_killed_worker_without_recovery_raises_and_engine_recovers(model_dir):
    path = model_dir("llama")
    with Engine(path, tp=2, dp=1, dtype="float64", recover_failed_workers=False, worker_class=FAULT_WORKER) as engine:
        pids = engine.worker_pids()
        inject_fault(engine, [1], "step", "exit")
        with pytest.raises(WorkerFailure, match="worker rank 1 .* died") as info:
            engine.generate([[5, 6, 7], [9]], SamplingParams(max_new_tokens=16), use_tqdm=False)
        partial = info.value.partial_outputs
        assert len(partial) == 2 and all(o.finish_reason == "error" for o in partial)
        # the engine restarted its workers and keeps serving
        out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8), use_tqdm=False)[0]
        assert out.token_ids == hf_greedy(path, [5, 6, 7], 8)
        assert not set(pids) & set(engine.worker_pids())
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_hung_worker_times_out_and_the_batch_completes(model_dir):
    path = model_dir("llama")
    with Engine(path, tp=2, dp=1, dtype="float64", step_timeout_s=3, worker_class=FAULT_WORKER) as engine:
        inject_fault(engine, [1], "step", "hang")
        out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8), use_tqdm=False)[0]
        assert out.token_ids == hf_greedy(path, [5, 6, 7], 8)
        assert "did not finish a step" in engine.worker_failures[-1]
