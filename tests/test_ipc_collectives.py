"""TP collectives through each other's slots, mapped by handle (parallel/ipc_collectives.py), between real
processes.

Ranks sharing a GPU take this channel with their slots in device memory (CUDA IPC); on the CPU the same
protocol runs with the slots in shared-memory files (``PAT_COLOCATED_COLLECTIVES=ipc``), which is what is
tested here: the same bits as the shared-memory channel (both add in rank order) over many back-to-back
calls of changing shapes (the two slot sets alternate), too-large tensors by the other path, a rank that
cannot map its peer's slots, and an engine's tokens unchanged through a live switch (a dead peer:
test_shm_collectives.py, for both channels). The CUDA side runs in
test_colocated_gpu.py (``gpu``).
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import MAX_NEW, PROMPTS, gloo_rank, wait_for_no_shared_memory_files
from local_cluster import free_port

from pat_engine.parallel import ipc_collectives, shm_collectives
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.group_pool import CommGroupPool
from pat_engine.parallel.layout import Layout

pytestmark = pytest.mark.skipif(not shm_collectives.board_usable("gloo"), reason="the host board needs x86-64")


def _agree_with_shared_memory(rank: int, world: int, port: int, failures, pids) -> None:
    pids.put(os.getpid())
    os.environ["PAT_COLOCATED_COLLECTIVES"] = "ipc"
    with gloo_rank(rank, world, port, failures):
        group, _ = CommGroupPool(rank, world, "gloo", datetime.timedelta(seconds=30)).get(Layout(world, 1))
        assert group.ipc is not None and group.shm is not None and group.collectives == "ipc"
        host = TPGroup(group.rank, group.size, group.ranks, group.device_group, shm=group.shm)
        g = torch.Generator().manual_seed(rank)
        for i in range(24):  # shapes change every call: both slot sets, and partial slot use
            rows = 1 + (i * 7) % 23
            dtype = (torch.float32, torch.bfloat16, torch.float64)[i % 3]
            x = torch.randn(rows, 48, generator=g).to(dtype)
            assert torch.equal(group.all_reduce(x.clone()), host.all_reduce(x.clone())), i  # rank order: same bits
            gathered, want_gather = group.gather_to_leader(x, dim=-1), host.gather_to_leader(x, dim=-1)
            assert (gathered is None) == (rank != 0) and (want_gather is None) == (rank != 0)
            if rank == 0:
                assert torch.equal(gathered, want_gather), i
            stacked = group.all_gather(x)  # every rank, rank order
            assert stacked.shape == (world, *x.shape) and torch.equal(stacked, host.all_gather(x)), i
            assert torch.equal(stacked[rank], x), i
        every = [None] * world
        dist.all_gather_object(every, group.all_reduce(torch.arange(5, dtype=torch.float32) * (rank + 1)).tolist())
        assert all(v == every[0] for v in every) and every[0] == [sum(range(1, world + 1)) * k for k in range(5)]
        big = torch.ones(ipc_collectives.SLOT_BYTES // 4 + 1)  # one float over a slot: the other path serves
        assert not group.ipc.fits(big)
        assert torch.equal(group.all_reduce(big), torch.full_like(big, world))
        assert torch.equal(group.all_gather(big * rank), torch.arange(world, dtype=big.dtype)[:, None] * big)


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("world", [2, 4])
def test_slots_by_handle_give_the_shared_memory_channels_bits(world):
    context = mp.get_context("spawn")
    failures, pid_queue = context.SimpleQueue(), context.SimpleQueue()
    start = time.time()
    mp.spawn(_agree_with_shared_memory, args=(world, free_port(), failures, pid_queue), nprocs=world)
    assert failures.empty(), failures.get()
    pids = [pid_queue.get() for _ in range(world)]
    assert not wait_for_no_shared_memory_files(pids, start)  # no slot outlives its ranks


def _one_rank_cannot_map(rank: int, port: int, failures, result) -> None:
    os.environ["PAT_COLOCATED_COLLECTIVES"] = "ipc"
    if rank == 1:  # as a driver that refuses to open an IPC handle would
        def refuse(*args, **kwargs):
            raise RuntimeError("CUDA error: invalid resource handle")
        ipc_collectives.rebuild = refuse
    with gloo_rank(rank, 2, port, failures):
        group, _ = CommGroupPool(rank, 2, "gloo", datetime.timedelta(seconds=60)).get(Layout(2, 1))
        x = torch.arange(6, dtype=torch.float32) * (rank + 1)
        result.put((rank, group.collectives, group.all_reduce(x).tolist()))


@pytest.mark.slow  # starts processes
def test_a_rank_that_cannot_map_its_peers_slots_sends_the_whole_group_the_other_way():
    context = mp.get_context("spawn")
    failures, result = context.SimpleQueue(), context.SimpleQueue()
    mp.spawn(_one_rank_cannot_map, args=(free_port(), failures, result), nprocs=2)
    assert failures.empty(), failures.get()
    got = sorted(result.get() for _ in range(2))
    assert [(r, path) for r, path, _ in got] == [(0, "shm"), (1, "shm")]  # both ranks agree: no IPC channel
    assert got[0][2] == got[1][2] == [3.0 * k for k in range(6)]


def test_which_groups_take_the_channel(monkeypatch):
    monkeypatch.delenv("PAT_COLOCATED_COLLECTIVES", raising=False)
    monkeypatch.delenv("PAT_CPU_COLLECTIVES", raising=False)
    assert ipc_collectives.wanted(host_staged=True, backend="gloo")  # ranks sharing a GPU
    assert not ipc_collectives.wanted(host_staged=False, backend="gloo")  # CPU workers: the shared-memory channel
    assert not ipc_collectives.wanted(host_staged=False, backend="nccl")
    monkeypatch.setenv("PAT_CPU_COLLECTIVES", "gloo")  # the CPU channel off: the device one is another switch
    assert ipc_collectives.wanted(host_staged=True, backend="gloo")
    assert ipc_collectives.colocated_path() == ipc_collectives.IPC
    monkeypatch.setenv("PAT_COLOCATED_COLLECTIVES", " Host ")
    assert not ipc_collectives.wanted(True, "gloo") and ipc_collectives.colocated_path() == "host-staged"
    monkeypatch.setenv("PAT_COLOCATED_COLLECTIVES", "ipc")
    assert ipc_collectives.wanted(False, "gloo") and not ipc_collectives.wanted(False, "nccl")
    monkeypatch.setenv("PAT_COLOCATED_COLLECTIVES", "nvlink")  # not a path: the default
    assert ipc_collectives.wanted(True, "gloo") and not ipc_collectives.wanted(False, "gloo")


def test_a_rank_reserves_slots_for_every_group_it_can_join():
    slots = 2 * ipc_collectives.SLOT_BYTES
    assert [ipc_collectives.reserve_bytes(w) // slots for w in (1, 2, 3, 4, 8)] == [0, 1, 1, 2, 3]


@pytest.mark.slow  # starts worker processes
def test_an_engine_through_the_slots_gives_the_unswitched_tokens(model_dir, monkeypatch):
    from pat_engine import Engine, SamplingParams

    # the workers inherit both: the protocols of ranks sharing a GPU (collectives through each other's
    # slots, a switch's moves by handle), on CPU workers through shared-memory files
    monkeypatch.setenv("PAT_COLOCATED_COLLECTIVES", "ipc")
    monkeypatch.setenv("PAT_SWITCH_P2P", "handles")
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in MAX_NEW]

    def tokens(**kw) -> list[list[int]]:
        return [o.token_ids for o in engine.generate(PROMPTS, params, use_tqdm=False, **kw)]

    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float64") as engine:
        assert [(s["collectives"], s["p2p"]) for s in engine.worker_stats()] == [("none", "handles")] * 2
        plain = tokens()
        assert tokens(switch_schedule=[(3, 2), (8, 1)], kv_transfer="migrate") == plain
        assert [e.to_layout for e in engine.switches[-2:]] == ["TP2xDP1", "TP1xDP2"]
        assert tokens(switch_schedule=[(2, 2)]) == plain  # left at TP2
        assert [s["collectives"] for s in engine.worker_stats()] == ["ipc"] * 2
        assert tokens() == plain
