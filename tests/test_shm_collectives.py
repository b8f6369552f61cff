"""Shared-memory TP collectives (parallel/shm_collectives.py) between real processes.

Same results as gloo (all-reduce, gather to the leader, all-gather), on every rank, over many back-to-back calls of changing shapes (the two
slot sets alternate); too-large tensors take gloo; a dead peer is an error within a second, on this channel
and on the IPC slots' (parallel/ipc_collectives.py), which meet on the same board.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import gloo_rank
from local_cluster import free_port

from pat_engine.parallel import shm_collectives
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.group_pool import CommGroupPool
from pat_engine.parallel.layout import Layout

pytestmark = [pytest.mark.slow,  # starts processes
              pytest.mark.skipif(not shm_collectives.usable("gloo"), reason="shared-memory collectives need x86-64")]


def _agree_with_gloo(rank: int, world: int, port: int, failures) -> None:
    with gloo_rank(rank, world, port, failures):
        group, _ = CommGroupPool(rank, world, "gloo", datetime.timedelta(seconds=30)).get(Layout(world, 1))
        assert group.shm is not None
        plain = TPGroup(group.rank, group.size, group.ranks, group.device_group)  # the gloo path
        g = torch.Generator().manual_seed(rank)
        for i in range(24):  # shapes change every call: both slot sets, and partial slot use
            rows = 1 + (i * 7) % 23
            x = torch.randn(rows, 48, dtype=torch.float64, generator=g)
            got, want = group.all_reduce(x.clone()), plain.all_reduce(x.clone())
            torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)  # gloo may sum in another order
            gathered, want_gather = group.gather_to_leader(x, dim=-1), plain.gather_to_leader(x, dim=-1)
            assert (gathered is None) == (rank != 0) and (want_gather is None) == (rank != 0)
            if rank == 0:
                assert torch.equal(gathered, want_gather), i
            stacked, want_stacked = group.all_gather(x), plain.all_gather(x)  # every rank, rank order
            assert stacked.shape == (world, *x.shape) and torch.equal(stacked, want_stacked), i
            assert torch.equal(stacked[rank], x), i
        every = [None] * world
        dist.all_gather_object(every, group.all_reduce(torch.arange(5, dtype=torch.float32) * (rank + 1)).tolist())
        assert all(v == every[0] for v in every)  # the same bits on every rank
        big = torch.ones(shm_collectives.SLOT_BYTES // 4 + 1)  # one float over a slot: gloo serves
        assert not group.shm.fits(big)
        assert torch.equal(group.all_reduce(big), torch.full_like(big, world))
        assert torch.equal(group.all_gather(big * rank), torch.arange(world, dtype=big.dtype)[:, None] * big)


def test_shared_memory_collectives_equal_gloo() -> None:
    """Two ranks, as TP2 on this machine; TP4 sums run in the float64 layout tests (tests/test_layouts.py)."""
    world = 2
    failures = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_agree_with_gloo, args=(world, free_port(), failures), nprocs=world)
    assert failures.empty()


def _peer_dies(rank: int, port: int, result, collectives: str) -> None:
    os.environ["PAT_COLOCATED_COLLECTIVES"] = collectives
    with gloo_rank(rank, 2, port):
        group, _ = CommGroupPool(rank, 2, "gloo", datetime.timedelta(seconds=60)).get(Layout(2, 1))
        assert group.collectives == ("ipc" if collectives == "ipc" else "shm")
        group.all_reduce(torch.ones(4))
        if rank == 1:
            os._exit(0)  # dies without a word
        start = time.monotonic()
        try:
            group.all_reduce(torch.ones(4))
            result.put("no error")
        except shm_collectives.CollectiveError as e:
            result.put(f"{time.monotonic() - start:.2f} {e}")


@pytest.mark.parametrize("collectives", ["auto", "ipc"])  # the CPU channel; the IPC slots on the same board
def test_dead_peer_is_an_error_not_a_hang(collectives) -> None:
    port = free_port()
    ctx = mp.get_context("spawn")
    result = ctx.SimpleQueue()
    procs = [ctx.Process(target=_peer_dies, args=(r, port, result, collectives)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    message = result.get()
    seconds, text = message.split(" ", 1)
    assert "died during a collective" in text and float(seconds) < 5, message
