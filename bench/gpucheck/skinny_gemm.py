"""Part ``gemm``: the decode step's GEMMs at 1-64 rows, cuBLAS beside the skinny Triton GEMM (issue 30).

At batch 1 the third H100 run's step spent 5.55 of its 6.20 GPU ms in GEMMs, and cuBLAS streamed some
weights far below the copy bandwidth (the o projection at 1.6 TB/s; split-K reduces on QKV and down).
``pat_kernels/skinny_matmul.py`` cuts each weight into many row tiles and K splits instead. This part
times, at each projection of the two model shapes (Llama-3-8B; Llama-3.2-1B without --quick) and at 1, 8
and 64 rows (and 16 and 32 without --quick): ``F.linear`` (cuBLAS), the kernel with its rule's config
(``config_for``: what ``PAT_SKINNY_GEMM`` runs) and a sweep of configs (tile rows, K step, splits; at one
row also the multiply-add path without tl.dot), as weight GB/s. The headline adds the layers' GEMMs and
the LM head up into a batch-1 step's GEMM milliseconds for each, which says what switching it on (and up
to how many rows) would save per token before any engine runs it, and the same step as the engine's setting
multiplies it (``PAT_SKINNY_GEMM``, by default auto: the bfloat16 LM head through the kernel, the layers
through cuBLAS, as the fourth H100 run of this part found them; ``model/gpu_gemm.skinny_rows``). GPU time
from CUDA events with the stream held busy ahead of each call, calls interleaved, median.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common import markdown_table
from gpucheck.report import PartResult
from gpucheck.shared import LLAMA32_1B, LLAMA3_8B, SMOKE_SPEC, Ctx, log, median, time_interleaved
from pat_engine.env import SKINNY_GEMM
from pat_engine.model import gpu_gemm
from pat_engine.tiny_model import TinyModelSpec


@dataclass(frozen=True)
class Projection:
    name: str
    n: int  # output features (weight rows)
    k: int  # input features
    per_step: int  # how many a decode step multiplies (one per layer; the LM head once)


def projections(spec: TinyModelSpec) -> list[Projection]:
    """A Llama-shaped model's decode GEMMs at TP1: QKV, o, gate/up, down (each layer) and the LM head."""
    h, inter, layers = spec.hidden_size, spec.intermediate_size, spec.num_layers
    hd = spec.head_dim or h // spec.num_heads
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    return [Projection("QKV", q + 2 * kv, h, layers), Projection("o", h, q, layers),
            Projection("gate/up", 2 * inter, h, layers), Projection("down", h, inter, layers),
            Projection("LM head", spec.vocab_size, h, 1)]


def sweep_configs(quick: bool, smoke: bool) -> list:
    """The configs timed beside the rule's (``SkinnyConfig``; split 1 to 8)."""
    from pat_kernels.skinny_matmul import SkinnyConfig

    if smoke:  # one split of each kind and each multiply (the interpreter takes seconds a config)
        return [SkinnyConfig(block_n=16, block_k=32, split_k=1, dot=True),
                SkinnyConfig(block_n=16, block_k=32, split_k=2, dot=False)]
    block_ks = (256,) if quick else (128, 256, 512)
    return [SkinnyConfig(block_n=bn, block_k=bk, split_k=s, dot=d) for bn in (16, 32, 64) for bk in block_ks
            for s in (1, 2, 4, 8) for d in (True, False)]


def gemm_case(p: Projection, rows: int, configs: list, sm: int, device: str, repeats: int, warmup: int) -> dict:
    """Seconds per call of cuBLAS, the rule's config and each config of the sweep (those with whole K steps
    in every split), one weight and input for all."""
    from pat_kernels.skinny_matmul import config_for, engine_config, row_tile, skinny_matmul

    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(p.n + p.k + rows)
    w = (torch.randn(p.n, p.k, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
    x = torch.randn(rows, p.k, generator=gen, device=dev).to(torch.bfloat16)
    rule = config_for(p.n, p.k, sm, row_tile(rows))
    engine = engine_config(p.n, p.k, dev, rows)  # this device's tuned config, else the rule
    steps = -(-p.k // rule.block_k)
    kept = [c for c in configs if -(-p.k // c.block_k) >= c.split_k and c != rule and (c.dot or rows == 1)]
    kept += [engine] if engine != rule and engine not in kept else []
    fns = {"cublas": lambda: F.linear(x, w), "rule": lambda: skinny_matmul(x, w, config=rule)}
    fns.update({c.label: (lambda c=c: skinny_matmul(x, w, config=c)) for c in kept})
    dropped = drop_unlaunchable(fns)
    ref = fns["cublas"]().float()
    scale = ref.abs().max().item() or 1.0
    rel = max((fns[n]().float() - ref).abs().max().item() for n in fns if n != "cublas") / scale
    times = {n: median(t) for n, t in time_interleaved(fns, repeats, warmup, dev).items()}
    nbytes = p.n * p.k * 2 + rows * p.k * 2 + rows * p.n * 2
    best = min((n for n in fns if n != "cublas"), key=lambda n: times[n])
    return {"name": p.name, "n": p.n, "k": p.k, "rows": rows, "per_step": p.per_step, "bytes": nbytes,
            "rule": rule.label, "rule_steps": steps, "cublas_s": times["cublas"], "rule_s": times["rule"],
            "best": rule.label if best == "rule" else best, "best_s": times[best], "engine": engine.label,
            "engine_s": times["rule" if engine == rule else engine.label],
            "gbps": {n: nbytes / t / 1e9 for n, t in times.items()}, "max_rel_diff": rel, "dropped": dropped}


def drop_unlaunchable(fns: dict) -> list[str]:
    """Call each skinny config once; drop (and name) those the device refuses: a 64-row tile of 64 x 256 in 4
    stages asks 256 KiB of shared memory, more than an H100 gives a block (227 KiB). The rule's config is
    not probed: it is what the engine runs, so its failure fails the part."""
    from triton.runtime.errors import OutOfResources

    dropped = []
    for name in [n for n in fns if n not in ("cublas", "rule")]:
        try:
            fns[name]()
        except OutOfResources:
            dropped.append(name)
            del fns[name]
    return dropped


def step_ms(cases: list[dict], rows: int, key: str) -> float:
    """A decode step's GEMM milliseconds at ``rows`` rows: each projection's time x how many a step runs."""
    return sum(c[key] * c["per_step"] for c in cases if c["rows"] == rows) * 1e3


def engine_takes_skinny(c: dict) -> bool:
    """Whether a bf16 CUDA engine, as ``PAT_SKINNY_GEMM`` is set now, multiplies this case's projection at its
    rows with the skinny GEMM (the engine's config: tuned, else the rule) rather than cuBLAS."""
    return c["rows"] <= gpu_gemm.skinny_rows("cuda", torch.bfloat16, lm_head=c["name"] == "LM head")


def engine_step_ms(cases: list[dict], rows: int) -> float:
    """``step_ms`` with each projection multiplied as the engine's setting multiplies it."""
    return sum((c["engine_s"] if engine_takes_skinny(c) else c["cublas_s"]) * c["per_step"]
               for c in cases if c["rows"] == rows) * 1e3


def run(ctx: Ctx) -> PartResult:
    if ctx.smoke:
        specs, rows_list, repeats, warmup = {"toy": SMOKE_SPEC}, (1, 4), 1, 0  # the interpreter: seconds a call
    else:
        specs = {"Llama-3-8B": LLAMA3_8B} if ctx.quick else {"Llama-3-8B": LLAMA3_8B, "Llama-3.2-1B": LLAMA32_1B}
        rows_list = (1, 8, 64) if ctx.quick else (1, 8, 16, 32, 64)
        repeats, warmup = (20 if ctx.quick else ctx.args.repeats), 5
    configs = sweep_configs(ctx.quick, ctx.smoke)
    sm = ctx.sm_count
    sections, headlines, data = [], [], {}
    for model, spec in specs.items():
        cases = []
        for p in projections(spec):
            for rows in rows_list:
                c = gemm_case(p, rows, configs, sm, ctx.device, repeats, warmup)
                cases.append(c)
                log(f"gemm {model} {p.name} x{rows}: cuBLAS {c['gbps']['cublas']:.0f} GB/s, rule {c['rule']} "
                    f"{c['gbps']['rule']:.0f} GB/s, best {c['best']} {c['bytes'] / c['best_s'] / 1e9:.0f} GB/s"
                    + (f"; dropped (out of resources): {', '.join(c['dropped'])}" if c["dropped"] else ""))
        table = markdown_table(
            ["projection", "N x K", "rows", "cuBLAS us", "cuBLAS GB/s", "rule (rows x K step / splits)", "rule us",
             "rule GB/s", "rule / cuBLAS time", "best config", "best us", "best GB/s", "engine's config (tuned)",
             "engine's us", "max abs diff / max abs out"],
            [[c["name"], f"{c['n']} x {c['k']}", c["rows"], c["cublas_s"] * 1e6, c["gbps"]["cublas"], c["rule"],
              c["rule_s"] * 1e6, c["gbps"]["rule"], c["rule_s"] / c["cublas_s"], c["best"], c["best_s"] * 1e6,
              c["bytes"] / c["best_s"] / 1e9, c["engine"], c["engine_s"] * 1e6, c["max_rel_diff"]] for c in cases])
        per_step = [[rows, step_ms(cases, rows, "cublas_s"), step_ms(cases, rows, "rule_s"),
                     step_ms(cases, rows, "best_s"), engine_step_ms(cases, rows)] for rows in rows_list]
        setting = f"PAT_SKINNY_GEMM={SKINNY_GEMM.value()}"
        steps = markdown_table(["rows", "cuBLAS ms / step", "skinny rule ms / step", "skinny best-per-shape ms / step",
                                f"the engine's ({setting}) ms / step"], per_step)
        one = per_step[0]
        headlines.append(f"{model}, the GEMMs of a batch-{one[0]} decode step: cuBLAS {one[1]:.3f} ms, skinny rule "
                         f"{one[2]:.3f} ms ({one[1] - one[2]:+.3f} ms saved), skinny best config per shape "
                         f"{one[3]:.3f} ms, the engine's ({setting}) {one[4]:.3f} ms ({one[1] - one[4]:+.3f} ms "
                         f"saved)")
        sections += [f"### {model} (hidden {spec.hidden_size}, intermediate {spec.intermediate_size}, "
                     f"{spec.num_layers} layers, vocab {spec.vocab_size})", table, steps]
        data[model] = [{k: c[k] for k in ("name", "n", "k", "rows", "cublas_s", "rule", "rule_s", "best", "best_s",
                                          "engine", "engine_s", "dropped")} for c in cases]
        dropped = sorted({f"{c['name']} x{c['rows']}: {d}" for c in cases for d in c["dropped"]})
        if dropped:
            sections.append("Configs the device refused (out of shared memory or registers), left out of the sweep: "
                            + "; ".join(dropped) + ".")
    if ctx.smoke:
        setup = ("**Smoke:** the toy model's shapes under TRITON_INTERPRET=1 (numpy) beside F.linear on the CPU; "
                 "the rule sees 132 SMs. Times measure the interpreter.")
        headlines = ["smoke: not judged"]
    else:
        setup = (f"bf16, TP1 shapes, {sm} SMs, random weights (std 0.02) and inputs. Config `R x K / S`: R weight "
                 f"rows a program, K columns a step of its walk, S K splits (summed by a second kernel); `fma`: one "
                 f"row's multiply-adds on the CUDA cores instead of tl.dot (timed at one row only); the rule's "
                 f"is `pat_kernels/skinny_matmul.config_for`; the engine's is the device's tuned config where "
                 f"`pat_kernels/skinny_tuned.json` has the shape (`bench/skinny_tune.py` writes it from this part's "
                 f"best configs), else the rule. GB/s counts the "
                 f"weight, the input and the output once. {repeats} calls of each after {warmup} warm-ups, "
                 f"interleaved, median. The per-step rows add each projection's time x the layers (the LM head "
                 f"once). Sweep: {len(configs)} configs (those with a whole K step in every split).")
    return PartResult("\n\n".join([setup, *sections]), headlines, data)
