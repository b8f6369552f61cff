"""TP collectives between CPU worker processes: gloo (loopback TCP) vs the shared-memory channel.

    python bench/tp_collectives.py [--world 2] [--rounds 5]

``world`` processes, one torch thread each (as TP workers on this machine), build the TP group the
engine builds (``CommGroupPool``) and time ``all_reduce`` and ``gather_to_leader`` on the sizes a
decode step of the peer benchmark's checkpoint sends: hidden states of 1, 16 and 64 rows (all-reduce
after o_proj and down_proj, 2 per layer) and vocab-slice logits (the gather). Gloo and shared
memory alternate every round (A, B, A, B); the table gives medians and the ratio.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import markdown_table, write_result
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.group_pool import CommGroupPool
from pat_engine.parallel.layout import Layout
from local_cluster import free_port

HIDDEN, VOCAB = 512, 8192
CALLS = 200


def _us_per_call(fn, x: torch.Tensor) -> float:
    for _ in range(10):
        fn(x)
    start = time.perf_counter()
    for _ in range(CALLS):
        fn(x)
    return (time.perf_counter() - start) / CALLS * 1e6


def _worker(rank: int, world: int, port: int, rounds: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    shm_group, _ = CommGroupPool(rank, world, "gloo", datetime.timedelta(seconds=120)).get(Layout(world, 1))
    gloo_group = TPGroup(shm_group.rank, shm_group.size, shm_group.ranks, shm_group.device_group)
    rows = []
    for batch in (1, 16, 64):
        cases = [("all_reduce", torch.randn(batch, HIDDEN), lambda g: g.all_reduce),
                 ("gather logits", torch.randn(batch, VOCAB // world), lambda g: lambda x: g.gather_to_leader(x))]
        for op, x, bind in cases:
            gloo, shm = [], []
            for _ in range(rounds):
                gloo.append(_us_per_call(bind(gloo_group), x))
                shm.append(_us_per_call(bind(shm_group), x))
            rows.append([op, batch, list(x.shape), round(statistics.median(gloo), 1), round(statistics.median(shm), 1)])
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(args.world, free_port(), args.rounds, results), nprocs=args.world)
    rows = [r + [f"{r[3] / r[4]:.1f}x"] for r in results.get()]
    body = (f"{args.world} processes, 1 torch thread each, float32, {CALLS} calls per timing, median of "
            f"{args.rounds} interleaved rounds.\n\n"
            + markdown_table(["op", "batch", "tensor", "gloo us/call", "shared memory us/call", "gloo / shm"], rows))
    write_result(f"tp_collectives_world{args.world}", "TP collectives on CPU: gloo vs shared memory", body)


if __name__ == "__main__":
    main()
