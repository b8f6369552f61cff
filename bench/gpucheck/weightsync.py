"""Part ``weightsync``: ``Engine.update_weights`` GB/s (host and CUDA tensors) and
``update_weights_from_distributed`` from a trainer process (gloo; NCCL attempted: on one GPU it refuses two
ranks on one device), on a TP1 engine with graphs (issue 23)."""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import socket
import time
from typing import Any

import torch

from common import markdown_table
from gpucheck.checkpoint import checkpoint_tensors, load_tensors
from gpucheck.report import PartResult
from gpucheck.shared import Ctx, free_device_memory, log, median


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer_main(port: int, backend: str, device: str, pairs: list, group: str, conn, timeout_s: float) -> None:
    """Trainer rank 0 of the weight-update group: join, load the tensors, broadcast them on "go"."""
    try:
        import torch.distributed as dist

        from pat_engine.parallel.update_group import join_update_group

        if device == "cuda":
            torch.cuda.set_device(0)
        pg = join_update_group("127.0.0.1", port, 0, 2, group, backend, timeout_s)
        tensors = load_tensors(pairs, device)
        if device == "cuda":
            torch.cuda.synchronize()
        conn.send(("ready", None))
        if conn.recv() != "go":
            return
        t = time.perf_counter()
        for _, x in tensors:
            dist.broadcast(x, src=0, group=pg)
        if device == "cuda":
            torch.cuda.synchronize()
        conn.send(("done", time.perf_counter() - t))
        conn.recv()  # the engine has left the group
        dist.destroy_process_group(pg)
    except BaseException as exc:  # reported to the parent, which decides
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(exc).__name__}: {exc}".splitlines()[0][:300]))


def _distributed_update(engine, pairs: list, shapes: dict, backend: str, device: str,
                        timeout_s: float) -> tuple[int, float]:
    """One update_weights_from_distributed of ``pairs`` from a trainer process; (bytes, seconds)."""
    port, group = _free_port(), f"gpu-check-{backend}"
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_trainer_main,
                                           args=(port, backend, device, pairs, group, child, timeout_s), daemon=True)
    proc.start()
    try:
        engine.init_weights_update_group("127.0.0.1", port, 1, 2, group_name=group, backend=backend,
                                         timeout_s=timeout_s)
        if not parent.poll(timeout_s):
            raise TimeoutError("the trainer did not load its tensors in time")
        tag, info = parent.recv()
        if tag != "ready":
            raise RuntimeError(f"trainer: {info}")
        names = [n for _, n in pairs]
        dtypes = [str(shapes[n][1]).removeprefix("torch.") for n in names]
        dims = [list(shapes[n][0]) for n in names]
        nbytes = sum(math.prod(shapes[n][0]) * shapes[n][2] for n in names)
        parent.send("go")
        t = time.perf_counter()
        engine.update_weights_from_distributed(names, dtypes, dims, group_name=group, timeout_s=timeout_s)
        secs = time.perf_counter() - t
        if parent.poll(timeout_s):
            tag, info = parent.recv()
            if tag == "error":
                raise RuntimeError(f"trainer: {info}")
        parent.send("bye")
        engine.destroy_weights_update_group(group)
        return nbytes, secs
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


class _EngineSlot:
    """The part's TP1 engine, restarted after a failed collective (it may leave the worker's group half-made)."""

    def __init__(self, ctx: Ctx):
        self.ctx, self.engine = ctx, None

    def get(self):
        if self.engine is None:
            self.engine = self.ctx.start_engine(eager=False, max_batch=8, max_len=256, kv_tokens=8 * 256)
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def run(ctx: Ctx) -> PartResult:
    slot = _EngineSlot(ctx)
    try:
        return _measure(ctx, slot)
    finally:
        slot.close()


def _measure(ctx: Ctx, slot: _EngineSlot) -> PartResult:
    engine = slot.get()
    ckpt = ctx.checkpoint()
    pairs = checkpoint_tensors(ckpt)
    host = load_tensors(pairs, "cpu")
    shapes = {n: (tuple(x.shape), x.dtype, x.element_size()) for n, x in host}
    total = sum(x.numel() * x.element_size() for _, x in host)
    repeats = 1 if ctx.smoke else 2
    rows, notes = [], []

    def handed_over(items: list) -> Any:
        """Yield and forget: each tensor is freed once its bucket is sent (shared memory holds ~1 bucket)."""
        items.reverse()
        while items:
            yield items.pop()

    def timed_update(tensors: list) -> float:
        count = len(tensors)
        t = time.perf_counter()
        applied = engine.update_weights(handed_over(tensors))
        assert applied == count, (applied, count)
        return time.perf_counter() - t

    # Pickling a host tensor moves its storage into shared memory (in place): fresh copies per update, as a
    # trainer hands over new tensors every step, so each timed update pays that copy.
    secs = [timed_update([(n, x.clone()) for n, x in host]) for _ in range(repeats)]
    rows.append(["update_weights, host tensors (copied into shared memory for the worker)", total / 1e9,
                 median(secs), total / median(secs) / 1e9])
    del host
    free_device_memory()
    if ctx.device == "cuda":
        try:
            on_gpu = load_tensors(pairs, "cuda")
            torch.cuda.synchronize()
            secs = [timed_update(list(on_gpu)) for _ in range(repeats)]
            rows.append(["update_weights, CUDA tensors of this process (CUDA IPC)", total / 1e9, median(secs),
                         total / median(secs) / 1e9])
            del on_gpu
        except Exception as exc:
            notes.append(f"update_weights with CUDA tensors failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        free_device_memory()
    else:
        notes.append("skipped on CPU: update_weights with CUDA tensors (needs CUDA)")
    log("update_weights done")

    limit = None if ctx.smoke else int(ctx.args.sync_gb * 1e9)
    subset = checkpoint_tensors(ckpt, limit)
    backends = ["gloo"] if ctx.smoke else ["gloo", "nccl"]
    for backend in backends:
        try:
            timeout = ctx.args.sync_timeout if backend == "gloo" else min(60.0, ctx.args.sync_timeout)
            nbytes, secs = _distributed_update(engine, subset, shapes, backend, ctx.device, timeout)
            rows.append([f"update_weights_from_distributed, {backend}, trainer process on the same "
                         f"{'GPU' if ctx.device == 'cuda' else 'host'}", nbytes / 1e9, secs, nbytes / secs / 1e9])
        except Exception as exc:
            msg = str(exc).strip().splitlines()
            notes.append(f"update_weights_from_distributed over {backend} failed: {type(exc).__name__}: "
                         f"{(msg[0] if msg else '')[:400]}")
            if backend != backends[-1]:
                slot.close()
                engine = slot.get()
        log(f"update_weights_from_distributed ({backend}) done")
    if ctx.smoke:
        notes.append("skipped on CPU: update_weights_from_distributed over NCCL (needs CUDA)")
    table = markdown_table(["path", "GB", "seconds", "GB/s"], rows)
    return PartResult("\n".join([
        f"A TP1 engine (graphs on); the update is applied at a step boundary with nothing "
        f"running. update_weights: every tensor of the checkpoint ({total / 1e9:.2f} GB), already in this "
        f"process's memory, default 256 MiB buckets, median of {repeats}. update_weights_from_distributed: the "
        f"first {sum(math.prod(shapes[n][0]) * shapes[n][2] for _, n in subset) / 1e9:.2f} GB of tensors "
        f"(--sync-gb), broadcast by a trainer process (group rank 0) to the engine's worker (rank 1); seconds "
        "from the call to its return (the trainer starts broadcasting as the call is made). On one GPU, NCCL "
        "refuses a communicator with two ranks on the same device (\"Duplicate GPU detected\") in the NCCL "
        "versions we know of, so the gloo row (CUDA tensors staged through host memory on both sides) is the "
        "one-GPU figure and the NCCL attempt's outcome is reported as it happened; NCCL's real figure needs "
        "two GPUs.",
        "",
        table,
        *(["", *[f"- {n}" for n in notes]] if notes else []),
    ]), [f"update_weights from CUDA tensors: {rows[1][3]:.1f} GB/s"] if len(rows) > 1 and ctx.device == "cuda" else [])
