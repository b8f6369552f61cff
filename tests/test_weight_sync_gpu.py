"""Weight sync on GPUs: NCCL update groups and CUDA IPC handles. None of these has run yet.

They skip without CUDA (the CPU stand-ins are in test_weight_handles.py, test_rl_api.py and
test_openrlhf_contract.py). An NCCL group cannot hold two ranks on one GPU, so the broadcast tests
put the trainer on cuda:1 and the engine's one worker on cuda:0 (two GPUs). The CUDA IPC test puts
both on cuda:0, as a colocated trainer is.
"""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import MAX_NEW, PROMPTS
from pat_engine import Engine, SamplingParams
from rl_helpers import perturbed_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL group needs one GPU per rank: 2 GPUs")
GREEDY = [SamplingParams(max_new_tokens=m) for m in MAX_NEW]


def tokens(engine: Engine) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]


def fresh(path: str) -> list[list[int]]:
    with Engine(path, dtype="float32", device="cuda") as engine:
        return tokens(engine)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_thread(fn, *args, **kwargs) -> threading.Thread:
    """Run a blocking engine call that needs the trainer's side of a collective at the same time."""
    errors: list[BaseException] = []

    def run():
        try:
            fn(*args, **kwargs)
        except BaseException as exc:  # re-raised by join()
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.errors = errors
    return t


def join(t: threading.Thread) -> None:
    t.join(300)
    assert not t.is_alive(), "the engine side did not finish"
    if t.errors:
        raise t.errors[0]


@pytest.fixture()
def step(model_dir, tmp_path) -> str:
    return perturbed_checkpoint(model_dir("llama"), tmp_path / "step", seed=41)


def broadcast_sync(engine: Engine, trainer_group_join, send, step: str, backend: str) -> None:
    weights = load_file(str(Path(step) / "model.safetensors"))
    port = free_port()
    joined = in_thread(engine.init_weights_update_group, "127.0.0.1", port, 1, 2, "g", backend)
    group = trainer_group_join(port)
    join(joined)
    names = list(weights)
    received = in_thread(engine.update_weights_from_distributed, names, [str(weights[n].dtype) for n in names],
                         [list(weights[n].shape) for n in names], "g")
    for n in names:
        send(group, weights[n].to("cuda:1"))
    join(received)


@two_gpus
def test_sglang_style_nccl_group(model_dir, step):
    from pat_engine.parallel.update_group import join_update_group

    def trainer(port):
        torch.cuda.set_device(1)
        return join_update_group("127.0.0.1", port, 0, 2, "g", "nccl", 120)

    def send(pg, tensor):
        torch.distributed.broadcast(tensor, src=0, group=pg)

    with Engine(model_dir("llama"), dtype="float32", device="cuda") as engine:
        before = tokens(engine)
        broadcast_sync(engine, trainer, send, step, "nccl")
        got = tokens(engine)
    assert got == fresh(step) and got != before


@two_gpus
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="OpenRLHF's NCCL group is vLLM's PyNccl")
def test_openrlhf_stateless_nccl_group(model_dir, step):
    from pat_engine.parallel.update_group import STATELESS_NCCL, join_stateless_nccl

    def trainer(port):  # OpenRLHF's stateless_init_process_group, rank 0
        return join_stateless_nccl("127.0.0.1", port, 0, 2, torch.device("cuda", 1))

    def send(comm, tensor):
        comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream(tensor.device))

    with Engine(model_dir("llama"), dtype="float32", device="cuda") as engine:
        before = tokens(engine)
        broadcast_sync(engine, trainer, send, step, STATELESS_NCCL)
        got = tokens(engine)
    assert got == fresh(step) and got != before


def test_openrlhf_update_weight_cuda_ipc(model_dir, step):
    """``_handle_cuda_ipc`` of OpenRLHF: handles keyed by the GPU's UUID, opened by the worker on that GPU."""
    from torch.multiprocessing.reductions import reduce_tensor

    from pat_integrations.openrlhf.actor import PatRolloutActor

    weights = [(n, t.to("cuda:0")) for n, t in load_file(str(Path(step) / "model.safetensors")).items()]
    uuid = str(torch.cuda.get_device_properties(0).uuid)

    async def run():
        actor = PatRolloutActor(model=model_dir("llama"), tensor_parallel_size=1, dtype="float32",
                                pat_engine_kwargs={"device": "cuda"})
        try:
            before = tokens(actor.engine)
            for i, (name, t) in enumerate(weights, start=1):
                weight = t.clone()  # the trainer's copy lives until the call returns
                await actor.update_weight_cuda_ipc(name, t.dtype, t.shape, {uuid: reduce_tensor(weight)},
                                                   empty_cache=i == len(weights))
            return before, tokens(actor.engine)
        finally:
            actor.shutdown()

    before, got = asyncio.run(run())
    assert got == fresh(step) and got != before
