"""Part ``profile``: ``pat-profile --emulate-world 8 --device cuda`` on a small grid, as a subprocess
(issue 30, item 5).

Each TP degree's rank-0 shard runs alone on this device the way the engine runs it (CUDA graphs for
decode, attention "auto", the median decode step) and the collectives it skips are charged from
pat-profile's ring model. What to read: per-rank decode time at small batch should fall with TP, as the
weight bytes per rank fall. Where the decode part ran on this checkpoint (this run or an earlier one in
the same results file), the predictor fitted to this table is set beside the engine's measured TP1
steps: that is its GPU error at TP1 (a real TP>1 error needs a multi-GPU machine).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from common import markdown_table
from gpucheck.report import PartResult, results_path
from gpucheck.shared import Ctx
from pat_engine.model.arch import load_model_arch
from pat_profiler.emulate import CollectiveModel

LINK_BW = 150e9  # pat-profile's default per-rank link bandwidth (bytes/s)
ROOT = Path(__file__).resolve().parents[2]


def grid(ctx: Ctx) -> list[str]:
    if ctx.smoke:
        return ["--emulate-world", "2", "--device", "cpu", "--graph-backend", "standin", "--tp", "1", "2",
                "--batch-sizes", "1", "2", "--context-lens", "16", "--decode-window", "3"]
    if ctx.quick:  # contexts 512 and 2048: the decode part's rows (64 x 512, 64 x 2K) lie on the table
        return _every_point([1, 2, 4, 8], [1, 64], [512, 2048], window=8)
    return _every_point([1, 2, 4, 8], [1, 16, 64], [256, 2048], window=16)


def _every_point(tps: list[int], batches: list[int], contexts: list[int], window: int) -> list[str]:
    """The arguments of a full batch x context grid: pat-profile's KV budget (65536 tokens by default) would
    drop 64 x 2048, and the third H100 run's predictor, without that knot, erred by -40% there."""
    budget = max(batches) * (max(contexts) + window + 2)  # pat_profiler.grid.build_grid's rule
    return ["--emulate-world", "8", "--device", "cuda", "--tp", *map(str, tps), "--batch-sizes", *map(str, batches),
            "--context-lens", *map(str, contexts), "--decode-window", str(window), "--kv-budget-tokens", str(budget)]


def falls_with_tp(decode_ms: dict[int, float]) -> bool:
    """Whether the step time falls at every doubling of TP (TP1 > TP2 > ...)."""
    tps = sorted(decode_ms)
    return len(tps) > 1 and all(decode_ms[a] > decode_ms[b] for a, b in zip(tps, tps[1:]))


def graphs_line(meta: dict | None) -> str:
    """What ``meta["graphs"]`` of an emulated table says: the backend, and per TP its captures and replays."""
    if not meta:
        return "not recorded (a table from before pat-profile ran graphs)"
    per_tp = "; ".join(f"TP{tp}: {g['captures']} captured ({g['capture_s_per_size'] * 1e3:.0f} ms each), "
                       f"{g['replays']} replays, {g['eager_decodes']} eager decodes"
                       for tp, g in sorted(meta.get("per_tp", {}).items(), key=lambda kv: int(kv[0])))
    return f"{meta.get('backend')}; {per_tp}"


def _ring(table) -> CollectiveModel:
    m = table.deployment.collective_model or {}
    return CollectiveModel(m.get("link_bandwidth", LINK_BW), m.get("latency_s", 8e-6))


def per_rank_ms(table, arch) -> dict[tuple[int, int], dict[int, tuple[float, float]]]:
    """(batch, context) -> TP -> (measured ms, modelled collectives ms) of each point's decode step: the table
    stores their sum; the model's charge is recomputed from its stated constants."""
    ring, elt = _ring(table), table.model.elt_bytes
    out: dict[tuple[int, int], dict[int, tuple[float, float]]] = {}
    for p in table.points:
        comm = ring.forward_s(arch, p.tp, p.batch_size, p.batch_size, elt)
        out.setdefault((p.batch_size, p.context_len), {})[p.tp] = ((p.decode_step_s - comm) * 1e3, comm * 1e3)
    return out


def collective_line(table, num_layers: int) -> str:
    """The ring model's constants, and what its hop latency alone charges a step at the largest TP."""
    ring, top = _ring(table), max(table.tps())
    hops_ms = (2 * num_layers + 1) * 2 * (top - 1) * ring.latency_s * 1e3
    return (f"ring all-reduces at {ring.link_bandwidth / 1e9:.0f} GB/s a link and {ring.latency_s * 1e6:.0f} us a "
            f"hop, 2 a layer + 1, each 2(T-1) hops: at TP{top} the hops alone charge {hops_ms:.1f} ms a step, "
            f"whatever the batch")


def predictor_rows(table, decode_rows: list[dict]) -> list[list]:
    """[batch, prompt, predicted ms, engine driver ms, error, engine worker ms] per decode-part graphs row."""
    from pat_engine.predictor.predictor import LatencyPredictor

    pred = LatencyPredictor(table)
    out = []
    for d in decode_rows:
        ms = float(pred.step_seconds(1, d["batch"], d["batch"] * d["mean_context"])) * 1e3
        out.append([d["batch"], d["prompt"], ms, d["step_ms"], ms / d["step_ms"] - 1, d["forward_ms"]])
    return out


def run(ctx: Ctx) -> PartResult:
    from pat_engine.predictor.table import ProfileTable

    timeout = ctx.args.profile_timeout
    out = ctx.workdir / ("profile_emulated_smoke.json" if ctx.smoke else "profile_emulated.json")
    out.unlink(missing_ok=True)
    argv = ["--model", str(ctx.checkpoint()), "--dtype", "bfloat16", *grid(ctx), "--output", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "TQDM_DISABLE": "1"}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pat_profiler.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    secs = time.perf_counter() - t
    shown = "pat-profile " + " ".join(shlex.quote(a) for a in argv)
    if proc.returncode != 0:
        raise RuntimeError(f"`{shown}` exited {proc.returncode} after {secs:.0f}s:\n{proc.stderr[-3000:]}")
    table = ProfileTable.load(out)
    points = sorted(table.points, key=lambda p: p.key)
    rows = [[p.tp, p.batch_size, p.context_len, p.prefill_s * 1e3, p.decode_step_s * 1e3, p.decode_step_std_s * 1e3,
             p.steps] for p in points]
    arch = load_model_arch(str(ctx.checkpoint()))
    split = per_rank_ms(table, arch)
    tps = table.tps()

    def pivot(pick) -> str:
        return markdown_table(["batch", "context"] + [f"TP{tp} ms" for tp in tps] + ["falls with TP"],
                              [[b, c] + [pick(ms[tp]) if tp in ms else "" for tp in tps]
                               + ["yes" if falls_with_tp({tp: pick(v) for tp, v in ms.items()}) else "no"]
                               for (b, c), ms in sorted(split.items())])

    small = min(split)  # the smallest batch at its shortest context
    measured = {tp: v[0] for tp, v in split[small].items()}
    charged = {tp: v[0] + v[1] for tp, v in split[small].items()}
    headlines = [f"**emulated per-rank decode step (measured, graphs on) at batch {small[0]}, context {small[1]}: "
                 + ", ".join(f"TP{tp} {ms:.2f} ms" for tp, ms in sorted(measured.items()))
                 + f": falls with TP: {'yes' if falls_with_tp(measured) else 'NO'}**",
                 "with the ring model's collectives charged: " + ", ".join(f"TP{tp} {ms:.2f} ms" for tp, ms in
                                                                          sorted(charged.items()))
                 + f" (falls with TP: {'yes' if falls_with_tp(charged) else 'no'})"]
    if ctx.smoke:
        headlines = ["smoke: not judged (stand-in graphs on the CPU)"]
    copied = ""
    if not ctx.smoke:  # beside the results file (bench/results/ by default)
        dest = results_path(ctx.args.output, ctx.smoke, ctx.args.workdir).parent / "gpu_check_profile_emulated.json"
        dest.write_text(out.read_text())
        copied = f" The table: `{dest.name}` beside this file."
    lines = [
        f"`{shown}` ({secs:.0f} s, a subprocess). Emulated: each TP degree's rank-0 shard runs alone on this device "
        f"with the engine's decode graphs ({graphs_line(table.meta.get('graphs'))}), attention \"auto\"; a point's "
        f"decode step is the median of its window, synchronised, in process (no driver round trip), plus the "
        f"collectives it skipped from the ring model; switch costs are modelled, not run.{copied}",
        "", "```", proc.stdout.strip()[-2000:], "```", "",
        "Per-rank decode ms / step as measured (the table's step less the collectives the model charged; it should "
        "fall with TP at small batch, as the weight bytes per rank fall):", "",
        pivot(lambda v: v[0]), "",
        f"The table's decode ms / step, measured + modelled collectives ({collective_line(table, arch.num_layers)}):",
        "",
        pivot(lambda v: v[0] + v[1]), "",
        markdown_table(["TP", "batch", "context", "prefill ms", "decode ms / step (median)", "decode std ms",
                        "steps"], rows),
    ]
    decode = ctx.previous.get("decode")
    if decode is not None and decode.status == "ok" and decode.data.get("rows"):
        pr = predictor_rows(table, decode.data["rows"])
        lines += ["", f"**The predictor's error at TP1** (LatencyPredictor fitted to this table, at the decode "
                  f"part's graphs rows, `{decode.command}` at {decode.date}): the engine's median step is driver-side "
                  f"(the worker round trip included), the table's is in process; the worker column is the engine "
                  f"worker's own forward + sampling.", "",
                  markdown_table(["batch", "prompt", "predicted ms", "engine ms (driver)", "error",
                                  "engine ms (worker)"], pr)]
        if not ctx.smoke:
            worst = max(pr, key=lambda r: abs(r[4]))
            headlines.append(f"predictor error at TP1 vs the engine's steps: worst {worst[4]:+.0%} "
                             f"(batch {worst[0]}, prompt {worst[1]})")
    data = {f"{b}x{c}": {tp: list(v) for tp, v in ms.items()} for (b, c), ms in split.items()}
    return PartResult("\n".join(lines), headlines, {"per_rank_ms": data})
