"""Part ``kernels``: where a decode step's GPU time goes, kernel by kernel (issue 30, items 2 and 6).

One ``InferExecutor`` in this process (Llama-3-8B shape, bf16, random weights, TP1, block 16; the engine's
attention "auto" and its Triton layer kernels), as the first H100 run's ``decode_step_kernels.txt``
(bench/results/gpu_2026-11-26_h100_first_run/) was made: at batch 1 and 64, prompts of 512 tokens are
prefilled, then decode steps run with CUDA graphs and eagerly in turn (wall ms per step, synchronised), then
graphs steps under ``torch.profiler`` (the host's phases beside the GPU's busy time: ``step_phases.py``), then
eager steps under ``torch.profiler`` (CPU + CUDA) with each step and each decoder layer labelled. Each
kernel is charged to the piece its name says (``classify``), to the step and to the layer whose range
it ran in (the profiled steps synchronise at the end of each layer, so a kernel runs inside its own). Target: <= 12 kernels per layer. On the CPU (smoke) there are no kernels: the table counts the
torch ops the step calls instead.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from common import markdown_table
from gpucheck import executor
from gpucheck.report import PartResult
from gpucheck.shared import Ctx, log, median, synchronize, verdict
from gpucheck.step_phases import StepPhases, describe, step_phases
from pat_engine import env
from pat_engine.env import SKINNY_MOST_ROWS
from pat_engine.model.gpu_gemm import PROLOGUE_MOST_ROWS
from pat_engine.model.layers import triton_ops

STEP, LAYER = "pat.step", "pat.layer"  # profiler ranges around a decode step and a decoder layer


@dataclass(frozen=True)
class Variant:
    """The step another way, as a ``PAT_*`` setting builds the executor (``executor.step_variant``'s keywords),
    timed with its own graphs, interleaved with the step as built."""

    setting: str
    skinny_rows: int | None = None
    fuse_reduce: bool | None = None
    prologue_rows: int | None = None
    pdl: bool | None = None


SKINNY = f"PAT_SKINNY_GEMM={SKINNY_MOST_ROWS}"
PROLOGUES = dict(skinny_rows=SKINNY_MOST_ROWS, prologue_rows=PROLOGUE_MOST_ROWS)
# The skinny GEMMs take this device's tuned configs where the table has the shape (pat_kernels/skinny_tuned.json)
VARIANTS = {"cuBLAS GEMMs": Variant("PAT_SKINNY_GEMM=off", skinny_rows=0),
            "skinny GEMMs": Variant(SKINNY, skinny_rows=SKINNY_MOST_ROWS),
            "fused attention reduce": Variant("PAT_DECODE_REDUCE=fused", fuse_reduce=True),
            "skinny GEMMs + prologues": Variant(f"{SKINNY} PAT_GEMM_PROLOGUE=fused", **PROLOGUES),
            "all three": Variant(f"{SKINNY} PAT_GEMM_PROLOGUE=fused PAT_DECODE_REDUCE=fused", fuse_reduce=True,
                                 **PROLOGUES),
            # programmatic dependent launch: with the defaults (the Triton layer kernels, attention and LM head),
            # and with every GEMM of the step a Triton kernel too, where each boundary can overlap
            "PDL": Variant("PAT_PDL=on", pdl=True),
            "all three + PDL": Variant(f"{SKINNY} PAT_GEMM_PROLOGUE=fused PAT_DECODE_REDUCE=fused PAT_PDL=on",
                                       fuse_reduce=True, pdl=True, **PROLOGUES)}

KERNELS_PER_LAYER_GOAL = 12
PIECES = ("GEMM", "attention", "norm", "rotary/KV write", "activation", "other")
# Substrings of kernel (or CPU op) names, lower case, first match wins: our Triton kernels by name, then
# what torch's own ops launch where the Triton kernels do not serve (RMSNorm's mean/rsqrt, rotary's neg,
# the KV write's index_copy), then cuBLAS / cuBLASLt (nvjet, splitKreduce) and CUTLASS GEMMs.
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("_decode_partial_kernel", "_decode_reduce_kernel", "_varlen_prefill_kernel", "decode_attention",
                   "flash", "fmha", "attention", "sdpa")),
    ("norm", ("_rms_norm_kernel", "rms_norm", "rmsnorm", "rsqrt", "meanops")),
    ("rotary/KV write", ("_rotary_kv_kernel", "rotary", "rotate", "index_copy", "write_kv", "neg_kernel")),
    ("activation", ("_silu_mul_kernel", "silu", "swiglu")),
    ("GEMM", ("nvjet", "cublas", "cutlass", "gemm", "xmma", "splitkreduce", "_matmul_kernel", "_skinny_reduce_kernel",
              "aten::mm", "aten::addmm",
              "aten::bmm", "linear", "aten::matmul")),
)


def classify(name: str) -> str:
    """The piece a kernel (or CPU op) belongs to, from its name."""
    low = name.lower()
    for piece, keys in RULES:
        if any(k in low for k in keys):
            return piece
    return "other"


@dataclass(frozen=True)
class KernelRecord:
    name: str
    us: float  # GPU time (CPU time for a CPU op)
    in_step: bool
    in_layer: bool


@dataclass
class KernelTable:
    """Per decode step: kernels and GPU ms, by piece; per layer: kernels, by piece."""

    steps: int
    layers: int  # layer ranges seen (steps x the model's layers)
    per_step: float
    per_layer: float | None  # None: no kernel could be charged to a layer
    ms_per_step: float
    by_piece: dict[str, tuple[float, float, float]]  # piece -> (kernels / step, GPU ms / step, kernels / layer)
    top: list[tuple[str, str, float, float]] = field(default_factory=list)  # (name, piece, ms / step, calls / step)


def kernel_table(records: Sequence[KernelRecord], steps: int, layers: int, top: int = 15) -> KernelTable:
    """Sum the records inside step ranges per step, and those inside layer ranges per layer."""
    if steps < 1:
        raise ValueError("no step was profiled")
    in_step = [r for r in records if r.in_step]
    in_layer = [r for r in in_step if r.in_layer]
    by_piece = {}
    for piece in PIECES:
        mine = [r for r in in_step if classify(r.name) == piece]
        per_layer = sum(1 for r in in_layer if classify(r.name) == piece) / layers if layers else 0.0
        by_piece[piece] = (len(mine) / steps, sum(r.us for r in mine) / steps / 1e3, per_layer)
    calls, time_us = Counter(), Counter()
    for r in in_step:
        calls[r.name] += 1
        time_us[r.name] += r.us
    ranked = sorted(time_us, key=lambda n: -time_us[n])[:top]
    return KernelTable(steps, layers, len(in_step) / steps, len(in_layer) / layers if layers and in_layer else None,
                       sum(r.us for r in in_step) / steps / 1e3, by_piece,
                       [(n, classify(n), time_us[n] / steps / 1e3, calls[n] / steps) for n in ranked])


def _labels(evt) -> set[str]:
    out = set()
    while evt is not None:
        if evt.name in (STEP, LAYER):
            out.add(evt.name)
        evt = evt.cpu_parent
    return out


def profiled_records(events, cuda: bool) -> tuple[list[KernelRecord], int, int, int]:
    """(records, step ranges, layer ranges, device events outside every step) of a profile taken around the
    profiled decode steps only.

    CUDA: a device event (kernel, copy; not the ranges' GPU shadows) belongs to the step or layer whose CPU
    range holds its start on the GPU. That holds because the profiled steps synchronise at the end of every
    range (``labelled_layers(sync=True)``, ``STEP``): a kernel cannot start before its launch, and it ends
    before its range does. Timestamps, not torch's op links, because Triton launches its kernels through the
    driver API, which torch.profiler does not link to an op (the first H100 run of this part lost every
    Triton kernel that way). CPU: the torch ops called from Python (an op whose parent is a range or nothing),
    at their CPU time."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    step_ranges = [(e.time_range.start, e.time_range.end) for e in cpu if e.name == STEP]
    layer_ranges = [(e.time_range.start, e.time_range.end) for e in cpu if e.name == LAYER]
    if not cuda:
        records = []
        for e in cpu:
            if not e.is_user_annotation and (e.cpu_parent is None or e.cpu_parent.is_user_annotation):
                labels = _labels(e)
                records.append(KernelRecord(e.name, e.cpu_time_total, STEP in labels, LAYER in labels))
        return records, len(step_ranges), len(layer_ranges), 0
    ranges = {e.name for e in cpu if e.is_user_annotation}
    device = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU
              and not e.is_user_annotation and e.name not in ranges]

    def inside(t: float, spans: list[tuple[float, float]]) -> bool:
        return any(a <= t <= b for a, b in spans)

    records = [KernelRecord(d.name, d.time_range.elapsed_us(), inside(d.time_range.start, step_ranges),
                            inside(d.time_range.start, layer_ranges)) for d in device]
    return records, len(step_ranges), len(layer_ranges), sum(not r.in_step for r in records)


@contextlib.contextmanager
def labelled_layers(sync: bool = False) -> Iterator[None]:
    """Every decoder layer's forward inside a ``LAYER`` range (restored afterwards); ``sync``: the range
    ends only once the layer's kernels have run, so their GPU start times fall inside it."""
    from pat_engine.model.llama import DecoderLayer

    inner = DecoderLayer.forward

    def forward(self, *args, **kwargs):
        with record_function(LAYER):
            out = inner(self, *args, **kwargs)
            if sync:
                torch.cuda.synchronize()
            return out

    DecoderLayer.forward = forward
    try:
        yield
    finally:
        DecoderLayer.forward = inner


@dataclass(frozen=True)
class Plan:
    batches: tuple[int, ...]
    prompt: int
    rounds: int  # rounds of ``block`` steps in each mode (graphs, eager, and the variants where they run)
    block: int
    profiled: int  # steps under the profiler, with graphs and then eager

    @property
    def steps(self) -> int:
        """Decode steps a batch runs at most: 2 warm-ups in each mode (graphs, eager, the variants), their
        rounds, both profiles."""
        modes = 2 + len(VARIANTS)
        return modes * 2 + self.rounds * modes * self.block + 2 * self.profiled


def plan(ctx: Ctx) -> Plan:
    if ctx.smoke:
        return Plan((1, 2), 16, 1, 2, 2)
    return Plan((1, 64), 512, 2 if ctx.quick else 4, 4, 8)


def build_executor(ctx: Ctx, p: Plan):
    """The in-process executor, its KV pool holding every batch's sequences with room for ``p.steps``."""
    room = p.steps + 1
    num_blocks = max(p.batches) * executor.blocks_for(p.prompt + room)
    return executor.build(ctx, num_blocks, ladder=tuple(sorted(p.batches)), max_context=p.prompt + room + 16)


def measure_batch(ctx: Ctx, ex, batch: int, p: Plan) -> dict:
    seqs = executor.Sequences(ex, executor.random_prompts(batch, p.prompt, ctx.spec.vocab_size, batch), p.steps + 1)
    seqs.prefill()
    for _ in range(2):  # warm-up: the graph's capture (lazy), then the eager path's first calls
        seqs.decode()
    with executor.eager(ex):
        for _ in range(2):
            seqs.decode()
    modes = {"graphs": contextlib.nullcontext, "eager": lambda: executor.eager(ex)}
    variants, refused = {}, {}
    for name, v in VARIANTS.items():
        if not runs(v, ex, batch):
            continue
        graphs = executor.more_graphs(ex)  # its own captures, over its kernels
        variant = (lambda g=graphs, v=v: executor.step_variant(
            ex, g, skinny_rows=v.skinny_rows, fuse_reduce=v.fuse_reduce, prologue_rows=v.prologue_rows,
            pdl=v.pdl))
        try:
            with variant():
                for _ in range(2):  # warm-up: its graph's capture, the kernels' compiles
                    seqs.decode()
        except Exception as exc:  # a launch this software stack refuses costs that variant only, not the part
            refused[name] = f"{type(exc).__name__}: {exc}"[:400]
            log(f"kernels: batch {batch}: variant {name!r} failed in its warm-up: {refused[name]}")
            continue
        modes[name] = variants[name] = variant
    walls: dict[str, list[float]] = {mode: [] for mode in modes}
    names = list(modes)
    for r in range(p.rounds):
        for mode in names[r % len(names):] + names[: r % len(names)]:  # the order rotates every round
            with modes[mode]():
                walls[mode] += [seqs.decode() for _ in range(p.block)]
    replay_ms = graph_replay_ms(ex, batch, p.block * p.rounds)
    variant_ms = {}
    for name, variant in variants.items():
        with variant():
            variant_ms[name] = {"ms": median(walls[name]) * 1e3,
                                "replay_ms": graph_replay_ms(ex, batch, p.block * p.rounds)}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device == "cuda" else [])
    cuda = ctx.device == "cuda"
    with profile(activities=activities) as prof:  # graphs steps: the host's phases beside the GPU's busy time
        for _ in range(p.profiled):
            with record_function(STEP):
                seqs.decode()
    phases = step_phases(prof.events(), STEP, cuda)
    with executor.eager(ex), labelled_layers(sync=cuda), profile(activities=activities) as prof:
        for _ in range(p.profiled):
            with record_function(STEP):
                seqs.decode()
                if cuda:
                    torch.cuda.synchronize()
    seqs.release()
    records, steps, layers, outside = profiled_records(prof.events(), cuda)
    return {"batch": batch, "graphs_ms": median(walls["graphs"]) * 1e3, "eager_ms": median(walls["eager"]) * 1e3,
            "steps_timed": len(walls["graphs"]), "table": kernel_table(records, steps, layers),
            "outside": outside, "replay_ms": replay_ms, "phases": phases, "variants": variant_ms,
            "refused": refused}


def runs(v: Variant, ex, batch: int) -> bool:
    """Whether a variant changes anything here: graphs on, and its GEMM rows (its prologue rows) serve this batch
    on a device Triton takes, or its attention knob exists (the Triton backend); PDL where the device and this
    Triton launch with it (else the variant is its twin without)."""
    if not ex.graphs.enabled:
        return False
    if v.pdl and not triton_ops.pdl_possible(ex.device):
        return False
    if v.prologue_rows is not None and (batch > v.prologue_rows or not triton_ops.serves(ex.device, ex.dtype)):
        return False
    if v.skinny_rows is not None:
        return batch <= SKINNY_MOST_ROWS and env.triton_runs_on(ex.device.type)
    return v.fuse_reduce is None or hasattr(ex.attention, "fuse_reduce")


@torch.inference_mode()  # the stand-in backend (CPU smoke) replays by running the forward
def graph_replay_ms(ex, batch: int, repeats: int) -> float | None:
    """Median ms of the batch's decode graph replayed alone (synchronised), over the last step's inputs:
    the forward's kernels and the gaps between them, without the step's host work, LM head or sampling.
    The replay rewrites the last token's K/V with the same values, so the sequences are unchanged."""
    size = next((s for s in ex.graphs.ladder if s >= batch), None) if ex.graphs.enabled else None
    graph = ex.graphs.graphs.get(size) if size is not None else None
    if graph is None:
        return None
    times = []
    for _ in range(repeats):
        synchronize(ex.device)
        t = time.perf_counter()
        graph.replay()
        synchronize(ex.device)
        times.append(time.perf_counter() - t)
    return median(times) * 1e3


def render(r: dict, cuda: bool) -> str:
    t: KernelTable = r["table"]
    unit = "kernels" if cuda else "torch ops"
    per_layer = f"{t.per_layer:.1f}" if t.per_layer is not None else "n/a (no kernel linked to a layer)"
    replay = "n/a (no graph)" if r["replay_ms"] is None else f"{r['replay_ms']:.3f}"
    lines = [f"### Batch {r['batch']}", "",
             f"Wall ms / step (median of {r['steps_timed']} each, interleaved): graphs **{r['graphs_ms']:.3f}**, "
             f"eager {r['eager_ms']:.3f}; the decode graph replayed alone {replay} (the rest of a graphs step is "
             f"its host work, LM head and sampling). Profiled eager step: {t.per_step:.0f} {unit} per step, "
             f"**{per_layer} per layer**, {'GPU' if cuda else 'CPU'} time {t.ms_per_step:.3f} ms per step.", ""]
    lines += [describe(r["phases"]), ""]
    if r["variants"]:
        lines += [f"The step other ways (each as its setting builds the executor, with its own graphs, interleaved "
                  f"with the graphs and eager steps above, built with `PAT_SKINNY_GEMM={env.SKINNY_GEMM.value()}`, "
                  f"`PAT_DECODE_REDUCE={env.DECODE_REDUCE.value()}`, "
                  f"`PAT_GEMM_PROLOGUE={env.GEMM_PROLOGUE.value()}` and `PAT_PDL={env.PDL.value()}`; the defaults, "
                  f"auto, kernel, off and off, send a bfloat16 LM head on CUDA through the skinny GEMM, every "
                  f"layer's GEMM to cuBLAS, the attention's splits to the reduce kernel and the norms and SiLU-mul "
                  f"to their own kernels, each kernel launched plainly; the skinny GEMMs take the device's tuned "
                  f"configs where `pat_kernels/skinny_tuned.json` has them; the PDL variants run only where the "
                  f"device and Triton launch with it): "
                  + "; ".join(f"{name} (`{VARIANTS[name].setting}`) graphs **{v['ms']:.3f}** ms / step, its graph "
                              f"replayed alone {v['replay_ms']:.3f}" for name, v in r["variants"].items())
                  + f" (as built: {r['graphs_ms']:.3f} and {replay}).", ""]
    if r["refused"]:
        lines += ["Variants that failed in their warm-up (left out): " + "; ".join(
            f"{name}: `{why}`" for name, why in r["refused"].items()), ""]
    if r["outside"]:
        lines += [f"{r['outside']} device events started outside every profiled step (counted nowhere).", ""]
    lines += [markdown_table(["piece", f"{unit} / step", "ms / step", f"{unit} / layer"],
                             [[piece, *vals] for piece, vals in t.by_piece.items()]), "",
              markdown_table(["kernel" if cuda else "op", "piece", "ms / step", "calls / step"],
                             [[f"`{n[:110]}`", piece, ms, calls] for n, piece, ms, calls in t.top])]
    return "\n".join(lines)


def headline(r: dict, cuda: bool) -> str:
    t: KernelTable = r["table"]
    per_layer = "n/a" if t.per_layer is None else f"{t.per_layer:.1f}"
    replay = "" if r["replay_ms"] is None else f" (its graph replayed alone: {r['replay_ms']:.2f} ms)"
    others = "".join(f"; {name} {v['ms']:.2f} ms with graphs (replayed alone: {v['replay_ms']:.2f} ms)"
                     for name, v in r["variants"].items())
    others += "".join(f"; {name} FAILED in its warm-up" for name in r["refused"])
    ph: StepPhases = r["phases"]
    idle = "" if ph.busy_ms is None else f", the GPU idle {ph.wall_ms - ph.busy_ms:.2f} ms of a profiled graphs step"
    return (f"batch {r['batch']}: {t.per_step:.0f} {'kernels' if cuda else 'torch ops'} per step, {per_layer} per "
            f"layer, {t.ms_per_step:.2f} ms of {'GPU' if cuda else 'CPU'} time; in-process step {r['graphs_ms']:.2f} "
            f"ms with graphs{replay}, {r['eager_ms']:.2f} ms eager{others}{idle}")


def run(ctx: Ctx) -> PartResult:
    p = plan(ctx)
    ex = build_executor(ctx, p)
    results = []
    for b in p.batches:
        results.append(measure_batch(ctx, ex, b, p))
        log(f"kernels: batch {b} done")
    cuda = ctx.device == "cuda"
    built = (f"attention backend \"{ex.attention.name}\", Triton layer kernels "
             f"{'on' if triton_ops.serves(ctx.device, ctx.dtype) else 'off'} (PAT_TRITON_LAYERS={env.triton_layers()})")
    headlines = [headline(r, cuda) for r in results]
    first = results[0]["table"]
    if cuda and first.per_layer is not None:
        headlines.append(f"**kernels per layer at batch {results[0]['batch']}: {first.per_layer:.1f} (target <= "
                         f"{KERNELS_PER_LAYER_GOAL}): {verdict(first.per_layer <= KERNELS_PER_LAYER_GOAL)}**")
    setup = (f"In this process: one InferExecutor ({'a toy Llama' if ctx.smoke else 'Llama-3-8B shape'}, bf16, "
             f"random weights, TP1, block 16, numerics \"fast\", {built}), prompts of {p.prompt} tokens "
             f"prefilled in one step, then decode steps: {p.rounds} round(s) of {p.block} steps with "
             f"{'CUDA graphs' if cuda else 'the stand-in graphs'} and {p.block} eager, in turn (after 2 + 2 warm-up "
             f"steps), then {p.profiled} eager steps under torch.profiler with each step and decoder layer in a "
             f"range. A kernel is charged to the piece its name says (GEMM: cuBLAS / nvjet / CUTLASS; our Triton "
             f"kernels by name; torch's own kernels by their op) and to the layer it ran in (the profiled steps "
             f"synchronise at the end of each layer, so a kernel starts inside its own layer's range); per layer = "
             f"kernels inside the layers' ranges / layers (the embedding, the final norm, the LM head and "
             f"sampling are outside every layer). Target: <= {KERNELS_PER_LAYER_GOAL} kernels per layer.")
    if not cuda:
        setup += (" **Smoke:** no kernels on the CPU; the table counts the torch ops the step calls from Python "
                  "(their CPU time), to check the machinery only.")
    body = "\n\n".join([setup, *[render(r, cuda) for r in results]])
    data = {"rows": [{"batch": r["batch"], "graphs_ms": r["graphs_ms"], "eager_ms": r["eager_ms"],
                      "replay_ms": r["replay_ms"], "variants": r["variants"], "refused": r["refused"],
                      "per_step": r["table"].per_step, "per_layer": r["table"].per_layer,
                      "ms_per_step": r["table"].ms_per_step, "phases": asdict(r["phases"])} for r in results]}
    return PartResult(body, headlines, data)
