"""Part ``switch``: the live switch on a GPU whose ranks share it, measured by phase (issue 32, items 3-4).

Model: Llama-3.2-1B's shape with random bf16 weights (``shared.LLAMA32_1B``, 2.47 GB, written once per
workdir). Engine: ``tp=1, dp=2`` on one device: both ranks on it (parallel/devices.py: each rank sizes its
KV from its memory share; a TP>1 group's collectives through each other's device memory (CUDA IPC slots,
parallel/ipc_collectives.py) unless ``PAT_COLOCATED_COLLECTIVES=host`` stages them through host copies;
TP>1 groups decode eagerly, TP1 groups keep their CUDA graphs; a switch's weights and KV pass by CUDA IPC
handle, device to device, unless ``PAT_SWITCH_P2P=host`` stages them through host memory: parallel/p2p.py),
graphs on, prefix caching off.
A long-tail batch merges to TP2xDP1 at decode step 16 while every request runs and splits back to
TP1xDP2 once only the long ones are left; each switch is
reported by phase: drain (steps in flight finished), groups, weights, KV, graphs (the graphs TP1 set aside
at the merge restored, and a capture of the sizes the unfinished requests can use that it lacks), and the
rest (plan, install, barriers, the driver's round trip), with bytes moved and peak extra memory. The first
batch is a warm-up (groups made, first TP2 kernels compiled, first captures) and is shown apart. Goal
(issue 32): the graphs phase <= 10% of the switch back to TP1.

Also: point-to-point GB/s a rank along both paths, by handle and staged through the host (interleaved),
decode steps per layout, CUDA memory per rank before and after the measured switches, and (full mode) the
way back to TP1 with the graphs TP1 set aside against the same switch after a release of the KV (which drops
every graph, so that return captures its sizes), interleaved, a TP1xDP4 -> TP4xDP1 merge and the capture
warm-ups (ms per size with 2 warm-ups each as the first H100 run
captured, with the engine's rule for new shapes, 2 for an epoch's first size and 1 for the rest, and for
shapes captured before, none), each of the two on its own: one that fails says so in its place and the
rest of the part stands. The switch back to TP1 restores the graphs start-up captured (the weights and the KV
layers are where they were: docs/switch.md, "The graphs phase"): its graphs phase is the restore. Two parts of their own, each in its own process, measure the same
deployment: ``controller`` (switch_controller.py) and ``collectives`` (collectives.py: what each
collective of a TP2 step costs along the IPC slots and host-staged).

Read the collectives' figures as one device's, not NVLink's; a switch's weights and KV, copied device to
device, move at HBM speed, above what NVLink would give: on one device this mode proves a switch's
mechanics (tokens, memory, recapture) and times everything but its communication. ``--quick``: one
measured batch (migrate) after the warm-up, the headline rows only.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common import markdown_table
from gpucheck.report import PartResult
from gpucheck.shared import LLAMA32_1B, SMOKE_SPEC, Ctx, free_device_memory, log, verdict
from pat_engine.tiny_model import TinyModelSpec

GRAPHS_SHARE_GOAL = 0.10
MiB = 1 << 20
PHASES = ("drain_s", "groups_s", "weights_s", "kv_s", "graphs_s")


@dataclass(frozen=True)
class Workload:
    """A long-tail batch: ``requests`` prompts of ``prompt`` tokens, the last ``tail`` of them ``long`` new
    tokens, the others ``short``; merged to TP ``high`` at decode step ``merge_at``, split back to TP1 at
    ``split_at`` (past ``short``: only the tail is left)."""

    requests: int
    prompt: int
    short: int
    long: int
    tail: int
    merge_at: int
    split_at: int

    def batch(self, vocab: int, seed: int = 0):
        from pat_engine import SamplingParams

        rng = np.random.default_rng(seed)
        prompts = rng.integers(16, min(vocab, 30000) - 1, (self.requests, self.prompt)).tolist()
        lengths = [self.short] * (self.requests - self.tail) + [self.long] * self.tail
        return prompts, [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in lengths]

    def schedule(self, high: int) -> list[tuple[int, int]]:
        return [(self.merge_at, high), (self.split_at, 1)]


def workload(smoke: bool) -> Workload:
    return Workload(6, 16, 6, 30, 2, 3, 12) if smoke else Workload(32, 512, 64, 320, 8, 16, 88)


def part_checkpoint(ctx: Ctx) -> tuple[TinyModelSpec, Path]:
    """The part's model (the 1B shape; the smoke spec on the CPU) and its checkpoint, written once per workdir."""
    spec = SMOKE_SPEC if ctx.smoke else LLAMA32_1B
    return spec, ctx.checkpoint(spec, "llama_smoke" if ctx.smoke else "llama32_1b_shape_bf16")


def engine_kwargs(device: str, smoke: bool) -> dict[str, Any]:
    """The part's engine options (the controller's table is measured with the same)."""
    kw: dict[str, Any] = dict(device=device, dtype="bfloat16", enable_prefix_caching=False)
    if smoke:
        kw["graph_backend"] = "standin"  # the CUDA graphs' bookkeeping, replayed eagerly on the CPU
    return kw


def start(ckpt: Path, world: int, device: str, smoke: bool, **extra: Any):
    """A TP1xDP``world`` engine over ``ckpt`` (KV from each rank's memory share on a GPU)."""
    from pat_engine import Engine

    kw = engine_kwargs(device, smoke) | dict(max_num_seqs=64, max_model_len=1024) | extra
    if device == "cuda":
        kw.setdefault("gpu_memory_utilization", 0.6)  # room for the other processes this part starts
    t = time.perf_counter()
    engine = Engine(str(ckpt), tp=1, dp=world, **kw)
    log(f"engine TP1xDP{world} started in {time.perf_counter() - t:.1f}s")
    return engine


def run_batch(engine, w: Workload, high: int, kv: str, vocab: int) -> tuple[float, list, list]:
    """(seconds, switch events, step records) of ``w`` at TP1, merged to TP ``high`` and split back."""
    prompts, params = w.batch(vocab)
    engine.reconfigure(1)
    before = len(engine.switches)
    t = time.perf_counter()
    with engine.record_steps() as steps:
        engine.generate(prompts, params, switch_schedule=w.schedule(high), kv_transfer=kv, use_tqdm=False)
    return time.perf_counter() - t, engine.switches[before:], list(steps)


def graphs_share(ev) -> float:
    return ev.costs["graphs_s"] / ev.seconds if ev.seconds else 0.0


def phase_row(label: str, ev) -> list:
    c = ev.costs
    rest = ev.seconds - sum(c[p] for p in PHASES)
    return [label, f"{ev.from_layout} -> {ev.to_layout}", ev.kv_path, c["requests"], ev.seconds,
            *(c[p] for p in PHASES), c["graphs_captured"], c.get("graphs_restored", 0), rest, f"{graphs_share(ev):.1%}",
            c["weight_bytes_sent"] / MiB, c["kv_bytes_sent"] / MiB, c["peak_extra_bytes"] / MiB]


PHASE_HEADERS = ["run", "switch", "KV path", "requests", "total s", "drain s", "groups s", "weights s", "KV s",
                 "graphs s", "graphs captured", "graphs restored", "rest s", "graphs share", "weights MiB sent",
                 "KV MiB sent",
                 "peak extra MiB"]


def decode_ms(steps: list) -> dict[str, str]:
    """Median decode step per layout (each group's steps, driver side), with its median batch."""
    out = {}
    for layout in sorted({f"TP{s.tp}xDP{s.dp}" for s in steps}):
        mine = [s for s in steps if not s.is_prefill and f"TP{s.tp}xDP{s.dp}" == layout]
        if mine:
            out[layout] = (f"{statistics.median(s.seconds for s in mine) * 1e3:.2f} ms at batch "
                           f"{statistics.median(s.batch_size for s in mine):.0f} ({len(mine)} steps)")
    return out


def memory_delta(before: list[dict], after: list[dict]) -> str:
    """Allocated and reserved CUDA memory per rank, after less before, in MiB."""
    if before[0]["device_memory"]["allocated"] is None:
        return "n/a (CPU)"

    def grew(b: dict, a: dict, key: str) -> str:
        return f"{(a['device_memory'][key] - b['device_memory'][key]) / MiB:+.1f} MiB"

    return "; ".join(f"rank {r}: allocated {grew(b, a, 'allocated')}, reserved {grew(b, a, 'reserved')}"
                     for r, (b, a) in enumerate(zip(before, after)))


def switch_rows(engine, w: Workload, high: int, kvs: tuple[str, ...], vocab: int,
                label: str) -> tuple[list[list], list, list, dict]:
    """Warm-up batch, then one measured batch per KV path: (rows, measured events, their steps, memory)."""
    secs, cold, _ = run_batch(engine, w, high, "migrate", vocab)
    rows = [phase_row(f"{label} warm-up", ev) for ev in cold]
    log(f"{label}: warm-up batch {secs:.1f}s")
    before = engine.worker_stats(release_cached=True)
    events, steps = [], []
    for kv in kvs:
        secs, evs, st = run_batch(engine, w, high, kv, vocab)
        rows += [phase_row(label, ev) for ev in evs]
        events += evs
        steps += st
        log(f"{label}: {kv} batch {secs:.1f}s, switches {[round(e.seconds, 3) for e in evs]}")
    after = engine.worker_stats(release_cached=True)
    return rows, events, steps, {"delta": memory_delta(before, after), "stats": after}


def capture_warmups(ctx: Ctx, ckpt: Path) -> list[list]:
    """ms per captured size, interleaved epochs: 2 warm-ups for every size, the engine's rule for shapes this
    process has not captured (2 for an epoch's first size, 1 for the rest), and for shapes it has (none: a
    switch back to a layout, a wake-up); and whether the replays of graphs captured without warm-ups give
    the eager tokens."""
    from gpucheck.executor import build
    from pat_engine.config import graph_ladder, graph_sizes_upto
    from pat_engine.worker.graph_capture import CaptureWarmups

    ladder, upto = graph_ladder(64), 32
    ex = build(ctx, 1024, ladder, 1024, ckpt=ckpt)
    settings = {"2 per size (new shapes)": (CaptureWarmups(2, 2), True),
                "2, then 1 (engine, new shapes)": (CaptureWarmups(), True),
                "none (engine, shapes captured before)": (CaptureWarmups(), False)}
    per_graph: dict[str, list[float]] = {k: [] for k in settings}
    for _ in range(3):
        for name, (warmups, forget) in settings.items():
            ex.graphs.drop()
            ex.graphs.warmups = warmups
            if forget:
                ex.graphs.forget_warm_shapes()
            before = ex.graphs.stats.warmup_forwards
            n, secs = ex.capture_graphs(upto)
            assert forget or ex.graphs.stats.warmup_forwards == before, "shapes captured before were warmed up"
            per_graph[name].append(secs / n)
    # the graphs held now were captured without warm-ups. Graphs read block tables as wide as the model allows,
    # eager steps as wide as the batch needs: the decode kernel's split count follows the width, so a bf16 near
    # tie of the random weights may pick another token
    same = ("yes" if decode_tokens(ex, graphs=True) == decode_tokens(ex, graphs=False)
            else "differ (another split count at the graphs' wider tables: a bf16 near tie?)")
    sizes = len(graph_sizes_upto(ladder, upto))
    del ex
    free_device_memory()
    return [[name, sizes, statistics.median(v) * 1e3, same if name.startswith("none") else ""]
            for name, v in per_graph.items()]


def apart(what: str, section) -> list[str]:
    """``section()``'s lines, or one line saying it failed (the part goes on: its other rows stand)."""
    try:
        return section()
    except Exception as exc:  # noqa: BLE001 - reported in the results, never hidden
        log(f"switch: {what} failed: {type(exc).__name__}: {exc}")
        return ["", f"**{what}: FAILED** ({type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''})"]


def four_ranks_section(ctx: Ctx, ckpt: Path, w: Workload, vocab: int, data: dict) -> list[str]:
    from pat_engine.errors import InvalidRequestError

    lines = ["", "**Four ranks on the device: TP1xDP4 -> TP4xDP1 -> TP1xDP4** (same batch, migrate):", ""]
    try:
        with start(ckpt, 4, ctx.device, ctx.smoke) as engine:
            rows4, events4, _, memory4 = switch_rows(engine, w, 4, ("migrate",), vocab, "TP1xDP4")
        lines += [markdown_table(PHASE_HEADERS, rows4), "", f"CUDA memory per rank: {memory4['delta']}."]
        data["switches4"] = [{"from": e.from_layout, "to": e.to_layout, "seconds": e.seconds, **e.costs}
                             for e in events4]
    except InvalidRequestError as exc:  # a share of a smaller GPU that cannot hold four ranks
        lines.append(f"not run: four ranks do not fit this device ({exc})")
    finally:
        free_device_memory()
    return lines


def restore_section(engine, w: Workload, vocab: int, headlines: list[str], rounds: int = 2) -> list[str]:
    """The switch back to TP1 with the graphs TP1 set aside at the merge, against the same switch in a batch
    after the KV's release (which drops every graph: that batch's TP1 steps capture the sizes they run
    before the merge, and its way back captures the smaller ones it then needs), interleaved; the headline
    is appended to ``headlines``."""
    rows: dict[str, list[list]] = {"graphs kept": [], "after a KV release": []}
    for _ in range(rounds):
        for label in rows:
            if label != "graphs kept":
                engine.sleep(tags=["kv_cache"])
                engine.wake_up(tags=["kv_cache"])
            _, events, _ = run_batch(engine, w, 2, "migrate", vocab)
            rows[label] += [phase_row(label, ev) for ev in events if ev.to_layout == "TP1xDP2"]
    graphs_s = {label: statistics.median(r[PHASE_HEADERS.index("graphs s")] for r in rs) for label, rs in rows.items()}
    counts = {label: (rs[-1][PHASE_HEADERS.index("graphs captured")], rs[-1][PHASE_HEADERS.index("graphs restored")])
              for label, rs in rows.items()}
    headlines.append("the switch back to TP1's graphs phase: " + "; ".join(
        f"{label} {graphs_s[label]:.3f} s ({counts[label][0]} captured, {counts[label][1]} restored)" for label in rows))
    return ["", f"**The way back to TP1, its graphs kept or dropped** ({rounds} rounds, interleaved: a batch as "
            "above, then one after `sleep(tags=['kv_cache'])` / `wake_up`, which drops every graph):", "",
            markdown_table(PHASE_HEADERS, [r for rs in rows.values() for r in rs])]


def warmups_section(ctx: Ctx, ckpt: Path, headlines: list[str]) -> list[str]:
    """The capture warm-ups' rows; their headline appended to ``headlines`` (smoke: the stand-in's rows, to check
    the code; it runs no warm-up forwards)."""
    rows = capture_warmups(ctx, ckpt)
    headlines.append("capture ms per size (TP1, sizes up to 32): " + ", ".join(f"{r[0]} {r[2]:.1f}" for r in rows)
                     + f"; graphs captured without warm-ups give the eager tokens: {rows[-1][3]}")
    return ["", "**Capture warm-ups** (TP1 shard in this process, capture of the sizes up to 32, median of 3 "
            "interleaved epochs; tokens of 4 decode steps of 8 requests through the graphs captured without "
            "warm-ups, against eager):", "",
            markdown_table(["warm-ups", "sizes", "ms per size", "graph tokens = eager tokens"], rows)]


def decode_tokens(ex, graphs: bool) -> list[list[int]]:
    """Tokens of 4 greedy decode steps of 8 requests, through the executor's graphs or eagerly."""
    import contextlib

    from gpucheck.executor import Sequences, eager, random_prompts

    seqs = Sequences(ex, random_prompts(8, 64, ex.arch.vocab_size, 3), room=16)
    seqs.prefill()
    out = []
    with contextlib.nullcontext() if graphs else eager(ex):
        for _ in range(4):
            seqs.decode()
            out.append(list(seqs.last))
    seqs.release()
    return out


P2P_WORDS = {"handles": "by handle (CUDA IPC: device copies)", "host": "staged through host memory (gloo)",
             "direct": "sent directly"}
P2P_SHORT = {"handles": "by handle", "host": "staged through host memory", "direct": "sent directly"}
P2P_ROUNDS = 2


def p2p_rates(engine, host_staged: bool, nbytes: int) -> dict[str, float]:
    """Bytes/s a rank along each point-to-point path this world can take (parallel/p2p.py), interleaved
    (A, B, A, B), best of each."""
    paths = ("host", "handles") if host_staged else ("direct", "handles")
    best = dict.fromkeys(paths, 0.0)
    for _ in range(P2P_ROUNDS):
        for path in paths:
            best[path] = max(best[path], engine.measure_bandwidth(nbytes, path=path))
    return best


def rates_line(rates: dict[str, float], used: str) -> str:
    return ", ".join(f"{P2P_SHORT[p]} {r / 1e9:.2f} GB/s" + (" (the switches')" if p == used else "")
                     for p, r in rates.items())


def tp_collectives(host_staged: bool) -> str:
    """How the world's TP>1 groups are set to reduce (parallel/comm.py), in words for the placement line. A
    group whose ranks cannot map each other's slots stages through the host instead, with a warning in the
    part's log; the ``collectives`` part and the co-located gpu test read the path a group took."""
    from pat_engine.parallel import ipc_collectives

    if not host_staged:
        return "by the world's backend (NCCL between GPUs, shared memory or gloo on the CPU)"
    if ipc_collectives.colocated_path() == ipc_collectives.IPC:
        return "set to go through each other's device memory (CUDA IPC slots)"
    return "staged through host copies (PAT_COLOCATED_COLLECTIVES=host)"


def run(ctx: Ctx) -> PartResult:
    from pat_engine.model.arch import load_model_arch

    spec, ckpt = part_checkpoint(ctx)
    vocab = load_model_arch(str(ckpt)).vocab_size
    w = workload(ctx.smoke)
    kvs = ("migrate",) if ctx.quick else ("migrate", "recompute")
    restore_headlines: list[str] = []
    with start(ckpt, 2, ctx.device, ctx.smoke) as engine:
        stats = engine.worker_stats()
        collectives = tp_collectives(stats[0]["host_staged"])
        where = (f"{len(stats)} ranks on {', '.join(sorted({s['device'] for s in stats}))}; TP>1 collectives "
                 f"{collectives}; a switch's weights and "
                 f"KV {P2P_WORDS[stats[0]['p2p']]}; "
                 f"{engine.memory.num_blocks(engine.layout)} KV blocks per rank at TP1xDP2")
        rows, events, steps, memory = switch_rows(engine, w, 2, kvs, vocab, "TP1xDP2")
        restore: list[str] = [] if ctx.quick else apart(
            "the way back with its graphs dropped", lambda: restore_section(engine, w, vocab, restore_headlines))
        probe_bytes = 8 * MiB if ctx.smoke else 64 * MiB
        rates = p2p_rates(engine, stats[0]["host_staged"], probe_bytes)
        small = p2p_rates(engine, stats[0]["host_staged"], MiB)  # what an exchange costs beside its bytes
        bandwidth = rates[stats[0]["p2p"]]
    free_device_memory()
    split = [ev for ev in events if ev.to_layout == "TP1xDP2"] or events  # the way back: its TP1 graphs
    worst = max(split, key=graphs_share)
    merge = next((ev for ev in events if ev.to_layout == "TP2xDP1"), events[0])
    steps_ms = decode_ms(steps)

    def phases(ev) -> str:
        c = ev.costs
        return (f"{ev.seconds:.3f} s = drain {c['drain_s']:.3f} + groups {c['groups_s']:.3f} + weights "
                f"{c['weights_s']:.3f} + KV {c['kv_s']:.3f} + graphs {c['graphs_s']:.3f} ({c['graphs_captured']} "
                f"sizes captured, {c.get('graphs_restored', 0)} restored) + rest")

    headlines = [
        f"**switch {worst.from_layout} -> {worst.to_layout} ({worst.kv_path}) with {worst.costs['requests']} "
        f"unfinished requests: {phases(worst)}; graphs {graphs_share(worst):.1%} of the switch (goal <= "
        f"{GRAPHS_SHARE_GOAL:.0%}: {verdict(graphs_share(worst) <= GRAPHS_SHARE_GOAL)})**",
        f"switch {merge.from_layout} -> {merge.to_layout} ({merge.kv_path}) with {merge.costs['requests']} "
        f"requests: {phases(merge)}"
        + (" (the co-located TP2 group decodes eagerly: nothing captured)"
           if not merge.costs["graphs_captured"] and not merge.costs.get("graphs_restored") else ""),
        f"point-to-point per rank: {rates_line(rates, stats[0]['p2p'])}; decode steps"
        + (f" (collectives {collectives}) " if stats[0]["host_staged"] else " ")
        + "; ".join(f"{k} {v}" for k, v in steps_ms.items()),
        f"CUDA memory across {len(events)} measured switches: {memory['delta']}",
    ]
    lines = [
        f"Model: {'the smoke spec' if ctx.smoke else 'Llama-3.2-1B shape'} (hidden {spec.hidden_size}, "
        f"{spec.num_layers} layers, {spec.num_heads} / {spec.num_kv_heads} heads, vocab {spec.vocab_size}), "
        f"random bf16. Placement: {where}. Batch: {w.requests} requests of {w.prompt} prompt tokens, "
        f"{w.requests - w.tail} of {w.short} new tokens and {w.tail} of {w.long} (ignore_eos, greedy); "
        f"schedule {w.schedule(2)} (decode step, TP).",
        "",
        "Each switch by phase (seconds driver-side; *rest* = total less the phases: plan, install, barriers, "
        "the round trip; bytes summed over the ranks; graphs share = graphs / total):",
        "",
        markdown_table(PHASE_HEADERS, rows),
        "",
        "Decode steps per layout (driver-side median over the measured batches): "
        + "; ".join(f"{k}: {v}" for k, v in steps_ms.items()) + ".",
        "",
        f"Point-to-point between the ranks, every rank sending {probe_bytes // MiB} MiB to the next at once "
        f"(Engine.measure_bandwidth along each path, interleaved, best of {P2P_ROUNDS} rounds of 3): "
        f"{rates_line(rates, stats[0]['p2p'])}; one exchange of 1 MiB takes "
        + ", ".join(f"{P2P_SHORT[p]} {MiB / r * 1e3:.2f} ms" for p, r in small.items())
        + " (a switch makes one a layer for its weights and one for its KV). CUDA memory per rank, after "
        f"the measured batches less before (each read after the rank returned its unused cached blocks, "
        f"Engine.worker_stats(release_cached=True)): {memory['delta']}.",
    ]
    headlines += restore_headlines
    lines += restore
    data: dict[str, Any] = {"switches": [{"from": e.from_layout, "to": e.to_layout, "kv": e.kv_path,
                                          "seconds": e.seconds, **e.costs} for e in events],
                            "bandwidth": bandwidth, "p2p": stats[0]["p2p"], "p2p_rates": rates,
                            "p2p_rates_1mib": small}
    if not ctx.quick:  # each piece on its own: one that fails keeps the rows above and the pieces after it
        lines += apart("four ranks", lambda: four_ranks_section(ctx, ckpt, w, vocab, data))
        lines += apart("capture warm-ups", lambda: warmups_section(ctx, ckpt, headlines))
    if ctx.smoke:
        headlines = ["smoke: not judged (CPU, stand-in graphs)"] + headlines[1:]
    return PartResult("\n".join(lines), headlines, data)
