"""Part ``collectives``: what a co-located TP2 decode step's collectives cost (issue 32, item 1: host
staging or CUDA IPC, "your choice, measured").

Two ranks share the GPU, their TP group built by the engine's ``CommGroupPool``, one process each as the
engine runs them. Each collective of a decode step of the ``switch`` part's 1B shape (an all-reduce of
batch x hidden, the logits gather of batch x vocab / 2) is timed along both paths the group has, taking
turns call by call: through each other's device memory (``ipc``, parallel/ipc_collectives.py, the
default) and staged through host copies (``host-staged``, ``PAT_COLOCATED_COLLECTIVES=host``, the fourth
H100 run's path: 0.6 ms an all-reduce, 20 ms of a 44 ms TP2 step). A batch-1 host-staged all-reduce is
also timed piece by piece (a kernel and its sync, to host, the host exchange, to device). On the CPU
(smoke runs) the group's own path only. Medians of 30 calls. No checkpoint: the shapes are all it needs.
"""

from __future__ import annotations

import dataclasses
import datetime
import queue as queue_module
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import markdown_table
from gpucheck.report import PartResult
from gpucheck.shared import LLAMA32_1B, SMOKE_SPEC, Ctx, log
from pat_engine.parallel.ipc_collectives import HOST_STAGED, IPC

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
    pool = CommGroupPool(rank, world, "gloo", timeout, host_staged=dev.type == "cuda", device=dev)
    group, _ = pool.get(Layout(world, 1))
    staged = dataclasses.replace(group, ipc=None)  # the same group without its device slots
    paths = {g.collectives: g for g in (group, staged)}  # ipc and host-staged on a GPU; the CPU's own path
    result: dict = {"paths": list(paths)}
    for name, rows, cols in shapes:
        x = torch.randn(rows, cols, dtype=dtype, device=dev)
        ops = {path: _op(g, name, x) for path, g in paths.items()}
        for path, secs in _median_seconds(ops, dev).items():
            result[f"{path} {name} {rows}x{cols}"] = secs
    first = next(((rows, cols) for name, rows, cols in shapes if name == "all_reduce"), None)
    if first is not None:
        result["pieces"] = _pieces(staged, torch.randn(*first, dtype=dtype, device=dev), dev)
    pool.close()
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def _op(group, name: str, x: torch.Tensor):
    if name == "all_reduce":
        return lambda: group.all_reduce(x.clone())
    return lambda: group.gather_to_leader(x, dim=-1)


def _median_seconds(ops: dict, dev: torch.device) -> dict[str, float]:
    """Median seconds of each op and the device sync after it, every rank starting together (a barrier),
    the ops taking turns call by call."""
    secs: dict[str, list[float]] = {name: [] for name in ops}
    for i in range(WARMUP + REPEATS):
        for name, op in ops.items():
            dist.barrier()
            t = time.perf_counter()
            op()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if i >= WARMUP:
                secs[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in secs.items()}


PIECES = ("a kernel + sync", "to host", "host exchange", "to device")


def _pieces(group, x: torch.Tensor, dev: torch.device) -> dict[str, float]:
    """A staged all-reduce's pieces, each timed alone with every rank at once: a kernel and the sync every
    piece ends with, the copy to the host, the exchange between the ranks' host copies (the CPU workers'
    path), the copy back. Tells whether the device round trips (two processes taking turns on one GPU)
    or the host exchange hold the time, which decides what a faster co-located collective would change."""
    host = x.cpu()
    ops = {PIECES[0]: lambda: x.add_(0), PIECES[1]: lambda: x.cpu(),
           PIECES[2]: lambda: group.all_reduce(host.clone()), PIECES[3]: lambda: x.copy_(host)}
    return {name: _median_seconds({name: op}, dev)[name] for name, op in ops.items()}


def time_collectives(world: int, device: str, shapes: list[tuple[str, int, int]],
                     dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Median seconds of each (op, rows, cols) along each path of a TP group of ``world`` ranks of one device,
    keyed "path op RxC" (the paths listed under "paths"); op is "all_reduce" (a row-parallel output) or
    "gather" (logits to the TP leader). Also "pieces": the first all-reduce's pieces along the host-staged
    path (``_pieces``), seconds each."""
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
                    raise RuntimeError(f"collectives: ranks exited {dead}" if dead else
                                       "collectives: no result within 300 s") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def collective_rows(ctx: Ctx, world: int) -> tuple[list[list], dict]:
    """Each collective of a TP``world`` decode step (fast numerics) along each path, timed on its shapes,
    and per step; and the raw timings (``time_collectives``)."""
    spec = SMOKE_SPEC if ctx.smoke else LLAMA32_1B
    batches = (1, 8) if ctx.smoke else (1, 8, 32)
    shard = -(-spec.vocab_size // world)
    shapes = [("all_reduce", b, spec.hidden_size) for b in batches] + [("gather", b, shard) for b in batches]
    got = time_collectives(world, ctx.device, shapes)
    rows = []
    for b in batches:
        for path in got["paths"]:
            reduce_s, gather_s = got[f"{path} all_reduce {b}x{spec.hidden_size}"], got[f"{path} gather {b}x{shard}"]
            per_step = (2 * spec.num_layers + 1) * reduce_s + gather_s  # o_proj + down_proj a layer, embedding, logits
            rows.append([b, path, reduce_s * 1e3, gather_s * 1e3, 2 * spec.num_layers + 1, per_step * 1e3])
    return rows, got


def run(ctx: Ctx) -> PartResult:
    rows, got = collective_rows(ctx, 2)
    log(f"collectives: paths {got['paths']}")
    step_ms = {(row[0], row[1]): row[-1] for row in rows}
    lines = ["Two processes on this device in one TP2 group (the `switch` part's shape: hidden "
             f"{(SMOKE_SPEC if ctx.smoke else LLAMA32_1B).hidden_size}); paths: `ipc`, through each other's "
             "device memory (the default); `host-staged`, CUDA tensors through host copies "
             "(`PAT_COLOCATED_COLLECTIVES=host`); taking turns call by call, median of 30 calls each; per step = "
             "2 all-reduces a layer + the embedding's + the logits gather; fast numerics.", "",
             markdown_table(["batch", "path", "all-reduce (batch x hidden) ms", "logits gather ms",
                             "all-reduces a step", "collectives a step ms"], rows), "",
             "Where a batch-1 host-staged all-reduce's time goes (each piece alone, both ranks at once, median "
             "ms; each ends with a device sync): "
             + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in got["pieces"].items()) + "."]
    batch = max(b for b, _ in step_ms)
    headline = "collectives of a co-located TP2 step at batch " + f"{batch}: " + ", ".join(
        f"{path} {step_ms[(batch, path)]:.2f} ms" for path in got["paths"])
    if {IPC, HOST_STAGED} <= set(got["paths"]):
        headline += f" ({step_ms[(batch, HOST_STAGED)] / step_ms[(batch, IPC)]:.1f}x by the IPC slots)"
    return PartResult("\n".join(lines), ["smoke: not judged (CPU)"] if ctx.smoke else [headline],
                      {"rows": rows, "timings": got})
