"""Weights by handle from a colocated trainer (``Engine.update_weights_from_handles``).

On CPU the handles are shared-memory file names (torch's ``file_system`` sharing strategy), the
stand-in for CUDA IPC handles on GPUs: the same reductions, the same code path in the workers.
The trainer is a separate process (``handle_trainer.py``); the driver only forwards the payloads.
The updated engine must give exactly what a fresh engine loaded with the new weights gives, in the
base layout and after a live switch. CUDA IPC itself is in the GPU-marked test at the end.
"""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import reduce_tensor

from conftest import MAX_NEW, PROMPTS
from handle_trainer import payloads
from pat_engine import Engine, InvalidRequestError, ModelLoadError, SamplingParams
from pat_engine.model.weights import byte_buckets
from pat_engine.model.weight_handles import (
    DeviceHandles, RankHandles, load_named_tensors, serialize, serialize_named_tensors, serialize_reduced,
)
from rl_helpers import CODE_PATHS, perturbed_checkpoint

GREEDY = [SamplingParams(max_new_tokens=m, logprobs=True) for m in MAX_NEW]
CPU = torch.device("cpu")
TRAINER = str(Path(__file__).with_name("handle_trainer.py"))
REBUILD_ELSEWHERE = ("import sys, torch; from pat_engine.model.weight_handles import load_named_tensors as load;"
                     "p = sys.stdin.buffer.read(); a = load([p], 0, torch.device('cpu')); b = load([p], 1, torch.device('cpu'));"
                     "print(a[0][0], float(a[0][1].sum()), float(b[0][1].sum()))")


def tokens(outs):
    return [o.token_ids for o in outs]


# ---- the payload format (no workers) ----------------------------------------------------------------


@pytest.mark.slow  # processes
def test_a_payload_is_rebuilt_by_another_process_more_than_once():
    """What every worker does: an unrelated process (another authkey) opens the same handle, twice."""
    t = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    payload = serialize_named_tensors([("w", t)])
    assert len(payload) < 1000  # a handle, not the values
    out = subprocess.run([sys.executable, "-c", REBUILD_ELSEWHERE], input=payload, capture_output=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(CODE_PATHS)}, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.split() == [b"w", b"66.0", b"66.0"]


def test_per_rank_and_per_device_entries_pick_the_worker_s_own():
    a, b = torch.zeros(2), torch.ones(2)
    per_rank = serialize([("x", RankHandles([serialize(a), serialize(b)]))])
    assert [float(load_named_tensors([per_rank], r, CPU)[0][1].sum()) for r in range(3)] == [0.0, 2.0, 0.0]
    per_worker = [serialize_named_tensors([("x", a)]), serialize_named_tensors([("x", b)])]
    assert float(load_named_tensors(per_worker, 1, CPU)[0][1].sum()) == 2.0
    by_device = serialize([("x", DeviceHandles({"cpu": serialize_reduced(reduce_tensor(b))}))])
    assert float(load_named_tensors([by_device], 0, CPU)[0][1].sum()) == 2.0
    elsewhere = serialize([("x", DeviceHandles({"GPU-0": serialize_reduced(reduce_tensor(b))}))])
    with pytest.raises(InvalidRequestError, match="no handle for this worker's device 'cpu'"):
        load_named_tensors([elsewhere], 0, CPU)


def test_a_payload_cannot_name_other_code():
    with pytest.raises(InvalidRequestError, match="posix.system|nt.system"):
        load_named_tensors([pickle.dumps([("x", os.system)])], 0, CPU)
    with pytest.raises(InvalidRequestError, match="list of \\(name, tensor\\) pairs"):
        load_named_tensors([serialize({"x": torch.zeros(1)})], 0, CPU)
    with pytest.raises(InvalidRequestError, match="cannot rebuild"):
        load_named_tensors([b"\x80\x04garbage"], 0, CPU)


def test_a_rebuilt_payload_is_released_when_its_reader_lets_go():
    """No reference cycle keeps what a reader rebuilt: its shared-memory files (and, on a GPU, its CUDA IPC
    mappings) end when the reader drops the tensors, not when the garbage collector next runs, which a
    killed process never waits for (the OpenRLHF actors' workers left a file per parameter so)."""
    payload = serialize_named_tensors([("w", torch.arange(12.0)), ("b", torch.ones(3))])
    gc.collect()
    gc.disable()
    try:
        named = load_named_tensors([payload], 0, CPU)
        assert [n for n, _ in named] == ["w", "b"]
        del named
        assert gc.collect() == 0  # nothing was left for the collector
    finally:
        gc.enable()


def test_byte_buckets_close_at_the_limit():
    named = [(str(i), torch.zeros(n)) for i, n in enumerate([1, 3, 4, 1, 1])]  # float32: 4 bytes each
    assert [[n for n, _ in b] for b in byte_buckets(named, 16)] == [["0", "1"], ["2"], ["3", "4"]]


# ---- the engine (worker processes) ---------------------------------------------------------------


def trainer(checkpoint: str, bucket_bytes: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, TRAINER, checkpoint, str(bucket_bytes)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.pathsep.join(CODE_PATHS)})


def push(engine: Engine, checkpoint: str, bucket_bytes: int = 64 << 10) -> tuple[int, int]:
    """The trainer process sends its weights by handle; returns (tensors applied, buckets)."""
    proc = trainer(checkpoint, bucket_bytes)
    seen = []

    def counted():
        for payload in payloads(proc):
            seen.append(len(payload))
            yield payload

    try:
        applied = engine.update_weights_from_handles(counted())
    finally:
        proc.stdin.close()
        assert proc.wait(60) == 0
    return applied, len(seen)


def reference(path: str):
    with Engine(path, tp=1, dp=2, dtype="float64") as fresh:
        return fresh.generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float64") as e:
        yield e


@pytest.fixture(scope="module")
def steps(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("handle_steps")
    return [perturbed_checkpoint(model_dir("llama"), root / f"step{i}", seed=20 + i) for i in (1, 2)]


@pytest.mark.slow
def test_weights_by_handle_equal_a_fresh_engine_in_base_and_switched_layouts(engine, model_dir, steps):
    step1, step2 = steps
    before = tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False))
    version = engine.weight_version

    applied, buckets = push(engine, step1)  # base layout TP1xDP2
    assert buckets > 3 and applied > 10
    assert engine.weight_version != version
    got, want = engine.generate(PROMPTS, GREEDY, use_tqdm=False), reference(step1)
    assert tokens(got) == tokens(want) and tokens(got) != before
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-9)

    engine.reconfigure(tp=2)  # the next update lands on TP2 shards
    assert str(engine.layout) == "TP2xDP1"
    push(engine, step2, bucket_bytes=1 << 20)
    got, want = engine.generate(PROMPTS, GREEDY, use_tqdm=False), reference(step2)
    assert str(engine.layout) == "TP2xDP1"
    assert tokens(got) == tokens(want) and tokens(got) != tokens(reference(step1))
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-9)

    engine.reconfigure(tp=1)
    engine.update_weights_from_disk(model_dir("llama"))  # back to the served checkpoint for later tests
    assert tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == before


@pytest.mark.slow
def test_bad_payloads_are_refused_and_the_engine_keeps_serving(engine):
    """Every worker refuses; the first refusal is the answer, the others' late replies are dropped
    (taken for a failure of the next step, they once restarted the workers)."""
    before = tokens(engine.generate(PROMPTS[:2], GREEDY[:2], use_tqdm=False))
    version, pids, failures = engine.weight_version, engine.worker_pids(), len(engine.worker_failures)
    wrong_shape = torch.zeros(3, 3, dtype=torch.float64)
    with pytest.raises(ModelLoadError, match="shape"):
        engine.update_weights_from_handles(serialize_named_tensors([("model.layers.0.mlp.up_proj.weight", wrong_shape)]))
    with pytest.raises(ModelLoadError, match="unknown weight"):
        engine.update_weights_from_handles(serialize_named_tensors([("model.layers.9.mlp.up_proj.weight", wrong_shape)]))
    with pytest.raises(InvalidRequestError, match="only torch tensor handles"):
        engine.update_weights_from_handles(pickle.dumps([("x", os.system)]))
    assert engine.weight_version == version
    time.sleep(1.0)  # let the other worker's refusals arrive
    assert tokens(engine.generate(PROMPTS[:2], GREEDY[:2], use_tqdm=False)) == before
    assert engine.worker_pids() == pids and len(engine.worker_failures) == failures


@pytest.mark.slow
def test_a_non_final_bucket_changes_the_output_but_not_the_version(engine, model_dir, steps):
    before = tokens(engine.generate(PROMPTS[:2], GREEDY[:2], use_tqdm=False))
    version = engine.weight_version
    from safetensors.torch import load_file

    moved = load_file(str(Path(steps[0]) / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    assert engine.update_weights_from_handles([serialize_named_tensors([(name, moved[name])])], final=False) == 1
    assert engine.weight_version == version
    assert tokens(engine.generate(PROMPTS[:2], GREEDY[:2], use_tqdm=False)) != before
    engine.update_weights_from_disk(model_dir("llama"))
    assert tokens(engine.generate(PROMPTS[:2], GREEDY[:2], use_tqdm=False)) == before


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_handles_equal_a_fresh_engine(model_dir, tmp_path):
    """Never run on a GPU yet: CUDA tensors from this process, opened by the workers as IPC handles."""
    from safetensors.torch import load_file

    step = perturbed_checkpoint(model_dir("llama"), tmp_path / "step", seed=31)
    weights = {k: v.cuda() for k, v in load_file(str(Path(step) / "model.safetensors")).items()}
    with Engine(model_dir("llama"), tp=1, dp=1, dtype="float32", device="cuda") as engine:
        engine.update_weights_from_handles([serialize_named_tensors(weights.items())])
        got = tokens(engine.generate(PROMPTS, GREEDY, use_tqdm=False))
    with Engine(step, tp=1, dp=1, dtype="float32", device="cuda") as fresh:
        assert got == tokens(fresh.generate(PROMPTS, GREEDY, use_tqdm=False))
