"""What the co-located mode's collectives cost: ranks sharing one GPU, their TP group built by the engine's
``CommGroupPool`` (gloo, CUDA tensors staged through the host: parallel/devices.py), timed on the tensors
a decode step reduces and gathers. One process per rank, as the engine runs them; median of the calls."""

from __future__ import annotations

import datetime
import queue as queue_module
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPEATS, WARMUP = 30, 5


def _rank(rank: int, world: int, port: int, device: str, shapes: list[tuple[str, int, int]], dtype: torch.dtype,
          out) -> None:
    from pat_engine.parallel.group_pool import CommGroupPool
    from pat_engine.parallel.layout import Layout

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    group, _ = CommGroupPool(rank, world, "gloo", timeout, host_staged=dev.type == "cuda").get(Layout(world, 1))
    result: dict = {}
    for name, rows, cols in shapes:
        x = torch.randn(rows, cols, dtype=dtype, device=dev)
        op = (lambda: group.all_reduce(x.clone())) if name == "all_reduce" else \
            (lambda: group.gather_to_leader(x, dim=-1))
        result[f"{name} {rows}x{cols}"] = _median_seconds(op, dev)
    first = next(((rows, cols) for name, rows, cols in shapes if name == "all_reduce"), None)
    if first is not None:
        result["pieces"] = _pieces(group, torch.randn(*first, dtype=dtype, device=dev), dev)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def _median_seconds(op, dev: torch.device) -> float:
    """Median seconds of ``op`` and the device sync after it, every rank starting together (a barrier)."""
    secs = []
    for i in range(WARMUP + REPEATS):
        dist.barrier()
        t = time.perf_counter()
        op()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i >= WARMUP:
            secs.append(time.perf_counter() - t)
    return statistics.median(secs)


PIECES = ("a kernel + sync", "to host", "host exchange", "to device")


def _pieces(group, x: torch.Tensor, dev: torch.device) -> dict[str, float]:
    """A staged all-reduce's pieces, each timed alone with every rank at once: a kernel and the sync every
    piece ends with, the copy to the host, the exchange between the ranks' host copies (the CPU workers'
    path), the copy back. Tells whether the device round trips (two processes taking turns on one GPU)
    or the host exchange hold the time, which decides what a faster co-located collective would change."""
    host = x.cpu()
    ops = {PIECES[0]: lambda: x.add_(0), PIECES[1]: lambda: x.cpu(),
           PIECES[2]: lambda: group.all_reduce(host.clone()), PIECES[3]: lambda: x.copy_(host)}
    return {name: _median_seconds(op, dev) for name, op in ops.items()}


def time_collectives(world: int, device: str, shapes: list[tuple[str, int, int]],
                     dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Median seconds of each (op, rows, cols) on a host-staged TP group of ``world`` ranks of one device,
    keyed "op RxC"; op is "all_reduce" (a row-parallel output) or "gather" (logits to the TP leader). Also
    "pieces": the first all-reduce's pieces (``_pieces``), seconds each."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # an OS-chosen port
    procs = [ctx.Process(target=_rank, args=(r, world, store.port, device, shapes, dtype, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 300
    try:
        while True:  # a rank that dies is an error, not a hang
            try:
                return queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"staged collectives: ranks exited {dead}" if dead else
                                       "staged collectives: no result within 300 s") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
