"""Part ``attention``: decode attention bandwidth beside torch's SDPA, and the fused layer kernels beside
the torch formulas they replace (issue 30, items 1, 2 and 6).

Decode attention at the shapes RL produces (32 q / 8 KV heads, head_dim 128, bf16, page 16, pages
shuffled): torch's ``scaled_dot_product_attention`` on contiguous K/V (``enable_gqa=True``) as the
anchor; ``paged_decode_attention`` split as ``decode_split`` says (the engine's fast mode, the table
exactly as wide as the context, as an eager step sees it); and the same kernel at a sweep of split
counts, so the fast-mode rule can be set from measurement (the best split per shape, the programs per
SM it gives, its ratio to SDPA). KV GB/s counts each K and V byte once (the group's q heads share it).
Target: the rule's split >= 80% of SDPA's bandwidth at every shape.

A batch-1 step's attention at short contexts (64 to 2K tokens) is a matter of latency, not bandwidth (the
fourth H100 run: 10 us a layer, split kernel and reduce, at a 512-token context, where the KV takes under
1 us to stream): microseconds per call at each split count, the rule as CUDA graphs run it (the table
``GRAPHS_WIDTH`` tokens wide, so it asks for many splits and each row takes as many as its context holds)
and one split (no reduce kernel); and each split count again with the reduce fused into the split kernel
(``fuse_reduce``: the last split merges, no second launch), with its largest difference from the
two-kernel result.

Layer kernels (``pat_kernels/triton_{norm,activation,rotary}.py``) against the torch path a layer runs
without them, at 1, 64 and 256 rows of the 8B shape: GPU time and whether the bits are equal.
GPU time from CUDA events with the stream held busy ahead of each call (no launch overhead), calls
interleaved, median.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common import markdown_table
from gpucheck.report import PartResult
from gpucheck.shared import Ctx, log, median, time_interleaved, verdict

GOAL = 0.8  # issue 30: decode attention >= 80% of SDPA-on-contiguous-KV bandwidth
SHAPES = ((1, 32768), (2, 16384), (8, 4096), (64, 512), (64, 2048), (256, 1024))
SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)
LATENCY_SHAPES = ((1, 64), (1, 512), (1, 2048))  # batch-1 decode: the 6.0 ms goal's attention
GRAPHS_WIDTH = 8192  # a decode graph's table width (max_model_len) for the latency rows' rule
QUICK_SPLITS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Geometry:
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page: int = 16
    block_n: int | None = None  # None: the engine's DECODE_BLOCK_N


SMOKE_GEOMETRY = Geometry(heads=4, kv_heads=2, head_dim=16, page=16, block_n=16)
SMOKE_SHAPES = ((2, 64), (4, 32))
SMOKE_LATENCY_SHAPES = ((1, 48),)
SMOKE_GRAPHS_WIDTH = 256  # the interpreter pays for every program, even an empty split's


def sweep(context: int, block_n: int, candidates: tuple[int, ...], rule: int) -> list[int]:
    """Split counts worth timing: each split at least one ``block_n`` chunk of the context, and the rule's."""
    most = -(-context // block_n)
    return sorted({s for s in candidates if s <= most} | {rule})


def kv_bytes(batch: int, context: int, g: Geometry, elt: int = 2) -> int:
    return batch * context * g.kv_heads * g.head_dim * 2 * elt


def decode_case(batch: int, context: int, g: Geometry, candidates: tuple[int, ...], sm_count: int, device: str,
                repeats: int, warmup: int, seed: int = 0, width_tokens: int | None = None,
                fused_too: bool = False) -> dict:
    """Time SDPA on contiguous K/V, the rule's split and every split of the sweep on the same K/V. The rule sees
    a table ``width_tokens`` wide (default: as wide as the context, as an eager step). ``fused_too``: every
    split count above one also with the reduce fused (``fused_s``, ``fused_diff``)."""
    from pat_engine.model.layers.triton_attention import decode_split
    from pat_kernels.paged_decode_attention import paged_decode_attention

    dev = torch.device(device)
    block_n = block_n_of(g)
    gen = torch.Generator(device=dev).manual_seed(seed)
    per_seq = -(-context // g.page)
    blocks = batch * per_seq + 1  # one spare block nobody reads
    pages = torch.randn(2, blocks, g.page, g.kv_heads, g.head_dim, generator=gen, device=dev).to(torch.bfloat16)
    perm = torch.randperm(blocks - 1, generator=gen, device=dev)
    tables = perm[: batch * per_seq].view(batch, per_seq).to(torch.int32).contiguous()  # shuffled pages
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, g.heads, g.head_dim, generator=gen, device=dev).to(torch.bfloat16)
    scale = g.head_dim**-0.5
    # the same K/V, contiguous: (B, KVH, context, D)
    k, v = (pages[i][tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous() for i in (0, 1))
    q4 = q[:, :, None, :]  # (B, H, 1, D)
    rule = decode_split(batch, g.kv_heads, width_tokens or per_seq * g.page, sm_count, "fast", block_n).num_splits
    splits = sweep(context, block_n, candidates, rule)

    def ours(s: int, fused: bool = False):
        return lambda: paged_decode_attention(q, pages[0], pages[1], tables, lens, scale, num_splits=s,
                                              block_n=block_n, fuse_reduce=fused)

    fns = {"sdpa": lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)}
    fns.update({f"splits={s}": ours(s) for s in splits})
    fused = [s for s in splits if s > 1] if fused_too else []
    fns.update({f"fused={s}": ours(s, True) for s in fused})
    ref = fns["sdpa"]()[:, :, 0].float()
    diff = max((fns[f"splits={s}"]().float() - ref).abs().max().item() for s in splits)
    fused_diff = max(((fns[f"fused={s}"]() - fns[f"splits={s}"]()).float().abs().max().item() for s in fused),
                     default=None)
    times = {n: median(t) for n, t in time_interleaved(fns, repeats, warmup, dev).items()}
    nbytes = kv_bytes(batch, context, g)
    gbps = {n: nbytes / t / 1e9 for n, t in times.items()}
    best = max(splits, key=lambda s: gbps[f"splits={s}"])
    return {"batch": batch, "context": context, "kv_bytes": nbytes, "rule": rule, "best": best, "splits": splits,
            "sdpa_s": times["sdpa"], "rule_s": times[f"splits={rule}"], "best_s": times[f"splits={best}"],
            "gbps": {s: gbps[f"splits={s}"] for s in splits}, "sdpa_gbps": gbps["sdpa"],
            "split_s": {s: times[f"splits={s}"] for s in splits},
            "fused_s": {s: times[f"fused={s}"] for s in fused}, "fused_diff": fused_diff,
            "programs_per_sm": batch * g.kv_heads * best / sm_count, "max_abs_diff": diff}


def layer_kernel_cases(rows: int, hidden: int, inter: int, g: Geometry, device: str, repeats: int,
                       warmup: int) -> list[list]:
    """[op, rows, torch us, Triton us, speed-up, equal bits] for add+RMSNorm, SiLU-mul, rotary + KV write."""
    from pat_engine.model.arch import RopeSpec
    from pat_engine.model.layers.attention import TorchAttention
    from pat_engine.model.layers.norm import RMSNorm
    from pat_engine.model.layers.rotary import RotaryEmbedding, apply_rotary
    from pat_kernels.triton_activation import silu_and_mul
    from pat_kernels.triton_norm import add_rms_norm
    from pat_kernels.triton_rotary import rotary_kv_write

    dev, bf16 = torch.device(device), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(rows)

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev) * scale + shift).to(bf16)

    out = []
    norm = RMSNorm(hidden, 1e-5, bf16, dev)
    norm.weight.copy_(randn(hidden, scale=0.1, shift=1.0))
    x, res = randn(rows, hidden, scale=3.0), randn(rows, hidden)

    def norm_torch():  # the layer's own formula (what it runs where no kernel serves), after the add
        summed = x + res
        return norm._formula(summed), summed

    fns = {"torch": norm_torch, "triton": lambda: add_rms_norm(x, res, norm.weight, norm.eps)}
    out.append(["add + RMSNorm", rows, *_compare(fns, device, repeats, warmup)])

    gate_up = randn(rows, 2 * inter, scale=2.0)
    fns = {"torch": lambda: F.silu(gate_up[:, :inter]) * gate_up[:, inter:], "triton": lambda: silu_and_mul(gate_up)}
    out.append(["SiLU-mul", rows, *_compare(fns, device, repeats, warmup)])

    h, kvh, d = g.heads, g.kv_heads, g.head_dim
    rope = RotaryEmbedding(RopeSpec(theta=500000.0), d, 8192, bf16, dev)
    pos = torch.randint(0, 8192, (rows,), generator=gen, device=dev)
    slots = torch.randperm(rows * 4, generator=gen, device=dev)[:rows]
    qkv = randn(rows, (h + 2 * kvh) * d)
    blocks = rows * 4 // g.page + 1  # the slots are drawn from 4 x rows
    caches = {k: torch.zeros(2, blocks, g.page, kvh, d, dtype=bf16, device=dev) for k in ("torch", "triton")}
    inputs = {k: qkv.clone() for k in caches}
    write = TorchAttention()

    def rotary_torch():  # the layer's path without the kernel: gather cos/sin, rotate q and k, index_copy K/V
        x = inputs["torch"]
        cos, sin = rope.cos_sin(pos)
        qk = x[:, : (h + kvh) * d].view(rows, h + kvh, d)
        q, k = apply_rotary(qk, cos, sin).split([h, kvh], dim=1)
        write.write_kv(caches["torch"], k, x[:, (h + kvh) * d:].view(rows, kvh, d), slots)
        return q

    def rotary_triton():
        return rotary_kv_write(inputs["triton"], h, kvh, pos, rope.cos, rope.sin, caches["triton"], slots)

    equal = torch.equal(rotary_torch(), rotary_triton()) and torch.equal(caches["torch"], caches["triton"])
    times = time_interleaved({"torch": rotary_torch, "triton": rotary_triton}, repeats, warmup, device)
    t, k = median(times["torch"]) * 1e6, median(times["triton"]) * 1e6
    out.append(["rotary + KV write", rows, t, k, t / k, equal])
    return out


def _compare(fns: dict, device: str, repeats: int, warmup: int) -> list:
    """[torch us, Triton us, speed-up, equal bits] of two functions returning a tensor or a tuple of them."""
    def as_tuple(x):
        return x if isinstance(x, tuple) else (x,)

    equal = all(torch.equal(a, b) for a, b in zip(as_tuple(fns["torch"]()), as_tuple(fns["triton"]())))
    times = time_interleaved(fns, repeats, warmup, device)
    t, k = median(times["torch"]) * 1e6, median(times["triton"]) * 1e6
    return [t, k, t / k, equal]


def run(ctx: Ctx) -> PartResult:
    if ctx.smoke:
        g, shapes, candidates, repeats, warmup = SMOKE_GEOMETRY, SMOKE_SHAPES, (1, 2, 4), 1, 0  # the interpreter
        rows_list, hidden, inter = (1, 4), 64, 128
    else:
        g, shapes, warmup = Geometry(), SHAPES, 5
        candidates = QUICK_SPLITS if ctx.quick else SPLITS
        repeats = 20 if ctx.quick else ctx.args.repeats
        rows_list, hidden, inter = (1, 64, 256), ctx.spec.hidden_size, ctx.spec.intermediate_size
    sm = ctx.sm_count
    results = []
    for batch, context in shapes:
        r = decode_case(batch, context, g, candidates, sm, ctx.device, repeats, warmup)
        results.append(r)
        log(f"attention {batch} x {context}: SDPA {r['sdpa_gbps']:.0f} GB/s, rule ({r['rule']} splits) "
            f"{r['gbps'][r['rule']]:.0f} GB/s, best ({r['best']}) {r['gbps'][r['best']]:.0f} GB/s")
    head = markdown_table(
        ["shape (seqs x context)", "KV MB", "SDPA us", "SDPA GB/s", "rule's splits", "rule us", "rule GB/s",
         "rule / SDPA", "best splits", "best GB/s", "best / SDPA", "programs per SM at best", "max abs diff vs SDPA"],
        [[f"{r['batch']} x {r['context']}", r["kv_bytes"] / 1e6, r["sdpa_s"] * 1e6, r["sdpa_gbps"], r["rule"],
          r["rule_s"] * 1e6, r["gbps"][r["rule"]], r["gbps"][r["rule"]] / r["sdpa_gbps"], r["best"],
          r["gbps"][r["best"]], r["gbps"][r["best"]] / r["sdpa_gbps"], r["programs_per_sm"], r["max_abs_diff"]]
         for r in results])
    every = sorted({s for r in results for s in r["splits"]})
    grid = markdown_table(["shape"] + [f"{s} split{'s' if s > 1 else ''}" for s in every],
                          [[f"{r['batch']} x {r['context']}"] + [r["gbps"].get(s, "") for s in every] for r in results])
    worst = min(results, key=lambda r: r["gbps"][r["rule"]] / r["sdpa_gbps"])
    ratio = worst["gbps"][worst["rule"]] / worst["sdpa_gbps"]
    headlines = [f"**decode attention, the rule's split vs SDPA: worst {ratio:.0%} at {worst['batch']} x "
                 f"{worst['context']} (target >= {GOAL:.0%} at every shape): {verdict(ratio >= GOAL)}**",
                 "best split per shape: " + ", ".join(f"{r['batch']}x{r['context']} -> {r['best']} "
                                                      f"(rule {r['rule']})" for r in results)]
    width = SMOKE_GRAPHS_WIDTH if ctx.smoke else GRAPHS_WIDTH
    latency = [decode_case(batch, context, g, candidates, sm, ctx.device, repeats, warmup, width_tokens=width,
                           fused_too=True) for batch, context in (SMOKE_LATENCY_SHAPES if ctx.smoke else LATENCY_SHAPES)]
    for r in latency:
        r["best_fused"] = min(r["fused_s"], key=r["fused_s"].get) if r["fused_s"] else None
    latency_table = markdown_table(
        ["shape", "SDPA us", "rule's splits (graphs)", "rule us", "rule fused us", "1 split us", "best splits",
         "best us", "best fused splits", "best fused us", "fused vs two kernels: max abs diff"],
        [[f"{r['batch']} x {r['context']}", r["sdpa_s"] * 1e6, r["rule"], r["rule_s"] * 1e6,
          _us(r["fused_s"].get(r["rule"])), r["split_s"][1] * 1e6, r["best"], r["best_s"] * 1e6, r["best_fused"],
          _us(r["fused_s"].get(r["best_fused"])), r["fused_diff"]] for r in latency])
    headlines.append("batch-1 attention, us a call (rule as graphs run it / rule fused / best split / best fused): "
                     + ", ".join(f"{r['context']} tokens {r['rule_s'] * 1e6:.1f} / {_us_text(r['fused_s'].get(r['rule']))}"
                                 f" / {r['best_s'] * 1e6:.1f} ({r['best']}) / "
                                 f"{_us_text(r['fused_s'].get(r['best_fused']))} ({r['best_fused']})" for r in latency))
    layer_rows = [row for rows in rows_list for row in layer_kernel_cases(rows, hidden, inter, g, ctx.device,
                                                                           repeats, warmup)]
    unequal = [f"{op} at {rows} rows" for op, rows, *_, eq in layer_rows if not eq]
    headlines.append("fused layer kernels: bits equal to the torch formulas everywhere" if not unequal
                     else f"fused layer kernels: bits DIFFER for {', '.join(unequal)}")
    layers = markdown_table(["op", "rows", "torch us", "Triton us", "speed-up", "equal bits"], layer_rows)
    if ctx.smoke:
        setup = ("**Smoke:** toy shapes (4 q / 2 KV heads, head_dim 16, block_n 16) under TRITON_INTERPRET=1 "
                 "(numpy) beside SDPA on the CPU; the split rule sees 132 SMs. Times measure the interpreter.")
        headlines = ["smoke: goals not judged"]
    else:
        setup = (f"bf16, head_dim {g.head_dim}, {g.heads} q heads / {g.kv_heads} KV heads, page {g.page}, pages "
                 f"shuffled, {sm} SMs. The rule: decode_split(batch, 8, context, {sm}, \"fast\") with the table as "
                 f"wide as the context (under CUDA graphs the table is max_model_len wide and the rule may split "
                 f"more). {repeats} calls of each after {warmup} warm-ups, interleaved, median. Programs per SM at "
                 f"the best split = seqs x KV heads x splits / SMs (the rule aims at {_programs_per_sm()}).")
    body = "\n\n".join([setup, head, "KV GB/s at each split count (the sweep):", grid,
                        f"A batch-1 step's attention at short contexts, us a call (the rule with the table "
                        f"{width} tokens wide, as a decode graph runs it; a row takes as many splits as its "
                        f"{block_n_of(g)}-token chunks):", latency_table,
                        "Fused layer kernels vs the torch path (8B shape: hidden 4096, intermediate 14336, 32 / 8 "
                        "heads of 128; torch: RMSNorm's formula after the add, `F.silu(gate) * up`, gather cos/sin + "
                        "rotate q and k + index_copy of K/V):" if not ctx.smoke else "Fused layer kernels vs torch:",
                        layers])
    data = {"rows": [{k: r[k] for k in ("batch", "context", "rule", "best", "sdpa_gbps", "max_abs_diff")}
                     | {"gbps": {str(s): v for s, v in r["gbps"].items()}} for r in results],
            "latency": [{"batch": r["batch"], "context": r["context"], "rule": r["rule"], "sdpa_us": r["sdpa_s"] * 1e6,
                         "us": {str(s): t * 1e6 for s, t in r["split_s"].items()},
                         "fused_us": {str(s): t * 1e6 for s, t in r["fused_s"].items()},
                         "fused_diff": r["fused_diff"]} for r in latency]}
    return PartResult(body, headlines, data)


def _us(seconds: float | None) -> float | str:
    return "n/a" if seconds is None else seconds * 1e6


def _us_text(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e6:.1f}"


def block_n_of(g: Geometry) -> int:
    from pat_engine.model.layers.triton_attention import DECODE_BLOCK_N

    return g.block_n or DECODE_BLOCK_N


def _programs_per_sm() -> int:
    from pat_engine.model.layers.triton_attention import PROGRAMS_PER_SM

    return PROGRAMS_PER_SM
