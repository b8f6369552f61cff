"""A switch's point-to-point exchange (parallel/p2p.py) along each path, between real processes.

The ``handles`` path is the one ranks sharing a GPU take (CUDA IPC handles, device copies); on the CPU the
same protocol runs through shared-memory files, so its ordering (the sender's buffers usable again as soon
as ``exchange`` returns) and its pairing are tested here without a GPU. The same switch through CUDA IPC
runs in test_colocated_gpu.py (``gpu``).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import gloo_rank, wait_for_no_shared_memory_files
from local_cluster import free_port

from pat_engine.errors import InvalidRequestError
from pat_engine.parallel import p2p

WORLD = 3
# (src, dst) -> numel: ranks that only send (0), send and receive (1), only receive (2); uneven sizes, one
# of several MB
PATTERN = {(0, 1): 5, (0, 2): 1_500_001, (1, 2): 3, (1, 0): 0}


def _payload(src: int, dst: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) * (1 + src) + 1000 * dst).to(dtype)


def _exchange_in_turn(rank: int, port: int, failures, pids) -> None:
    pids.put(os.getpid())
    with gloo_rank(rank, WORLD, port, failures):
        for path in (p2p.DIRECT, p2p.HANDLES):
            for dtype in (torch.float64, torch.bfloat16):
                sends = {d: _payload(rank, d, n, dtype) for (s, d), n in PATTERN.items() if s == rank}
                recvs = {s: torch.full((n,), -1, dtype=dtype) for (s, d), n in PATTERN.items() if d == rank}
                p2p.exchange(sends, recvs, path)
                for buf in sends.values():
                    buf.fill_(-7)  # free to reuse at once: every peer has its copy already
                dist.barrier()
                for src, got in recvs.items():
                    assert torch.equal(got, _payload(src, rank, got.numel(), dtype)), (path, dtype, src)
        # the same buffers again and again (a switch's layers): views of one storage, shared once each time
        base = torch.arange(64, dtype=torch.float32) + rank
        for i in range(4):
            inp = torch.empty(16)
            p2p.exchange({(rank + 1) % WORLD: base[16 * i: 16 * (i + 1)]}, {(rank - 1) % WORLD: inp}, p2p.HANDLES)
            assert torch.equal(inp, torch.arange(16 * i, 16 * (i + 1), dtype=torch.float32) + (rank - 1) % WORLD), i
        with pytest.raises(RuntimeError, match="planned different exchanges"):  # both sides see the mismatch
            p2p.exchange({(rank + 1) % WORLD: torch.ones(4)}, {(rank - 1) % WORLD: torch.empty(5)}, p2p.HANDLES)


@pytest.mark.slow  # starts processes
def test_every_path_delivers_each_pairs_buffer_and_frees_the_senders_at_once():
    context = mp.get_context("spawn")
    failures, pid_queue = context.SimpleQueue(), context.SimpleQueue()
    start = time.time()
    mp.spawn(_exchange_in_turn, args=(free_port(), failures, pid_queue), nprocs=WORLD)
    assert failures.empty(), failures.get()
    pids = [pid_queue.get() for _ in range(WORLD)]
    assert not wait_for_no_shared_memory_files(pids, start)  # no file outlives the processes that exchanged


def test_each_world_takes_its_path(monkeypatch):
    monkeypatch.delenv("PAT_SWITCH_P2P", raising=False)
    assert p2p.path_for(host_staged=True) == p2p.HANDLES  # ranks sharing a GPU: CUDA IPC
    assert p2p.path_for(host_staged=False) == p2p.DIRECT  # NCCL between GPUs, gloo on the CPU
    monkeypatch.setenv("PAT_SWITCH_P2P", "host")
    assert p2p.path_for(True) == p2p.HOST and p2p.path_for(False) == p2p.DIRECT
    monkeypatch.setenv("PAT_SWITCH_P2P", " Handles ")
    assert p2p.path_for(True) == p2p.path_for(False) == p2p.HANDLES
    monkeypatch.setenv("PAT_SWITCH_P2P", "nccl")  # not a path: the default
    assert p2p.path_for(True) == p2p.HANDLES and p2p.path_for(False) == p2p.DIRECT


def test_a_path_the_world_cannot_take_is_named():
    p2p.check_path(p2p.HOST, host_staged=True)
    p2p.check_path(p2p.HANDLES, host_staged=False)
    with pytest.raises(ValueError, match="cannot send CUDA tensors directly"):
        p2p.check_path(p2p.DIRECT, host_staged=True)
    with pytest.raises(ValueError, match="unknown point-to-point path 'ipc'"):
        p2p.check_path("ipc", host_staged=False)


@pytest.mark.slow  # starts worker processes
def test_a_switch_by_handle_gives_the_unswitched_tokens(model_dir, monkeypatch):
    from pat_engine import Engine, SamplingParams

    monkeypatch.setenv("PAT_SWITCH_P2P", "handles")  # the workers inherit it
    prompts = [[1, 5, 9, 2], [7, 3], [4, 4, 8, 1, 6], [2, 9]]
    params = SamplingParams(max_new_tokens=12)
    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float64") as engine:
        assert [s["p2p"] for s in engine.worker_stats()] == [p2p.HANDLES] * 2
        plain = [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        switched = engine.generate(prompts, params, switch_schedule=[(3, 2), (8, 1)], kv_transfer="migrate",
                                   use_tqdm=False)
        assert [o.token_ids for o in switched] == plain
        events = engine.switches[-2:]
        assert [e.to_layout for e in events] == ["TP2xDP1", "TP1xDP2"] and all(e.ok for e in events)
        assert engine.measure_bandwidth(1 << 16, repeats=1, path=p2p.HANDLES) > 0
        assert engine.measure_bandwidth(1 << 16, repeats=1, path=p2p.DIRECT) > 0
        with pytest.raises(InvalidRequestError, match="unknown point-to-point path"):
            engine.measure_bandwidth(path="ipc")
