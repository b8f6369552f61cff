"""Part ``graphs``: CUDA graph capture seconds per ladder size, and the recapture after an emulated switch
(issue 23). Each shard is an ``InferExecutor`` in this process with the engine's own ``DecodeGraphs``
and random weights (capture does not depend on their values)."""

from __future__ import annotations

import time

import torch

from common import markdown_table
from gpucheck.report import PartResult
from gpucheck.shared import Ctx, free_device_memory, log

LINK_BW = 150e9  # pat-profile's default per-rank link bandwidth (bytes/s), for the modelled switch


def _executor(ctx: Ctx, arch, world: int, tp: int, ladder: tuple[int, ...], max_context: int, num_blocks: int):
    from pat_engine.parallel.comm import TPGroup
    from pat_engine.parallel.layout import Layout
    from pat_engine.worker.graph_capture import GraphSettings
    from pat_engine.worker.infer_executor import InferExecutor
    from pat_profiler.emulate import EmulatedTPGroup

    group = TPGroup(rank=0, size=1, ranks=(0,)) if tp == 1 else EmulatedTPGroup(tp)
    layout = Layout(1, 1) if tp == 1 else Layout.for_world(world, tp)
    settings = GraphSettings("standin" if ctx.smoke else "cuda", ladder, max_context)
    ex = InferExecutor(arch, layout, group, ctx.dtype, torch.device(ctx.device), block_size=16,
                       num_blocks=num_blocks, graphs=settings)
    with torch.no_grad(), ex.writing_weights():  # random weights: capture does not depend on their values
        for p in ex.model.parameters():
            p.data.normal_(0.0, 0.02)
    return ex


def _timed_captures(ex) -> dict[int, float]:
    """Seconds of each size's capture from now on (the manager's per-size step, wrapped)."""
    times: dict[int, float] = {}
    inner = ex.graphs._capture_one

    def timed(b: int):
        t = time.perf_counter()
        graph = inner(b)
        times[b] = time.perf_counter() - t
        return graph

    ex.graphs._capture_one = timed
    return times


def run(ctx: Ctx) -> PartResult:
    from pat_engine.config import graph_ladder, graph_sizes_upto
    from pat_engine.model.arch import load_model_arch
    from pat_engine.parallel.layout import Layout
    from pat_engine.predictor.deployment import reshard_bytes

    arch = load_model_arch(str(ctx.checkpoint()))
    world = 2 if ctx.smoke else 8
    ladder = graph_ladder(8 if ctx.smoke else 256)
    max_context, num_blocks = (128, 32) if ctx.smoke else (4096, 512)
    uptos = (1, 4, 8) if ctx.smoke else (1, 8, 64, 256)
    switches = ((2, 1), (1, 2)) if ctx.smoke else ((2, 1), (1, 2), (2, 4), (4, 8))

    # (a) the TP1 ladder, one size at a time (largest first, as the engine captures)
    ex = _executor(ctx, arch, world, 1, ladder, max_context, num_blocks)
    times = _timed_captures(ex)
    n, total = ex.capture_graphs()
    per_size = markdown_table(["batch size", "capture ms"], [[b, times[b] * 1e3] for b in sorted(times)])
    log(f"TP1 ladder: {n} graphs in {total:.2f}s")

    # (b) an emulated switch: the target's rank-0 shard, a new pool (install drops the graphs), then the
    # capture a switch runs for `upto` unfinished requests
    rows, current = [], 1
    for src, dst in switches:
        if dst != current:
            del ex
            free_device_memory()
            ex, current = _executor(ctx, arch, world, dst, ladder, max_context, num_blocks), dst
            warm = ex.graphs.stats.warmup_forwards
            cold_n, cold_s = ex.capture_graphs(max(uptos))
            rows.append([f"TP{src}->TP{dst}", f"{max(uptos)}, first capture of this shard (cold)", cold_n,
                         ex.graphs.stats.warmup_forwards - warm, cold_s, cold_s / max(cold_n, 1) * 1e3, "", ""])
        moved = reshard_bytes(arch, ctx.dtype, Layout.for_world(world, src), Layout.for_world(world, dst))
        moved_s = moved / LINK_BW
        for upto in uptos:
            old = ex.kv
            ex.install(ex.layout, ex.tp, ex.new_pool(ex.layout, num_blocks), {})
            old.release()
            warm = ex.graphs.stats.warmup_forwards
            got, secs = ex.capture_graphs(upto)
            assert got == len(graph_sizes_upto(ladder, upto)), (got, upto)
            rows.append([f"TP{src}->TP{dst}", upto, got, ex.graphs.stats.warmup_forwards - warm, secs,
                         secs / max(got, 1) * 1e3, moved_s,
                         secs / (secs + moved_s) if moved_s else "n/a (no weight moves)"])
        log(f"emulated switch TP{src}->TP{dst} done")
    del ex
    free_device_memory()
    recapture = markdown_table(
        ["switch (emulated)", "upto (unfinished requests)", "graphs captured", "warm-up forwards", "recapture s",
         "ms per graph",
         f"modelled weight move s ({LINK_BW / 1e9:.0f} GB/s link)", "recapture share of (recapture + move)"], rows)
    return PartResult("\n".join([
        f"In this process, one InferExecutor per shard with the engine's own DecodeGraphs "
        f"({'stand-in' if ctx.smoke else 'torch.cuda.CUDAGraph'} backend, attention backend auto), random "
        f"bf16 weights of the checkpoint's shapes, block tables {max_context} tokens wide, ladder {list(ladder)}.",
        "",
        f"**TP1 ladder: {n} graphs in {total:.2f} s ({total / max(n, 1) * 1e3:.0f} ms per size on average).** "
        "Per size (each includes the backend's warm-up forwards, 2 for the first size and 1 for the others, "
        "and the synchronise after the capture):",
        "",
        per_size,
        "",
        "**Recapture after an emulated switch.** One GPU cannot run a switch (a switch needs a world of at "
        "least 2), so what is emulated: the target layout's TP rank-0 shard of a world of "
        f"{world} (pat-profile's EmulatedTPGroup: its collectives return local data, so no communication is "
        "timed), a fresh KV pool installed as a switch's KV phase installs it (which drops every graph), then "
        "`capture_graphs(upto)`, the call a switch makes in its timed graphs phase for a DP group with `upto` "
        "unfinished requests. The first row of each target shard is its first capture (cold: Triton compiles "
        "kernels for the new head counts; a long-lived worker pays this once per layout, and Triton's disk "
        "cache spares later processes). No switch time was measured on this machine, so the share is against "
        "a modelled switch: the busiest rank's weight bytes (the reshard plan's) over the link model "
        "pat-profile assumes; a real switch also pays its KV migration, group set-up and the drain, so the real "
        "share is lower. A switch to a higher TP moves no weights (each rank slices what it holds), so that "
        "share is n/a here. *Warm-up forwards*: run before the row's captures (graph_capture.CaptureWarmups): the "
        "TP1 shard, a group of one rank, captures shapes it has captured before without any; the emulated "
        "shards of TP2 and up stand for groups of several ranks, which always warm up (their warm-ups hold "
        "collectives).",
        "",
        recapture,
    ]), [f"TP1 ladder: {n} graphs in {total:.2f} s"])
