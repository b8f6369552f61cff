"""Part ``moe``: one Qwen3-30B-A3B-shaped MoE layer's experts on the GPU, the fused Triton kernels beside the
per-expert path (the issue 30 brief: few kernels a layer, graphs on for decode).

The layer (hidden 2048, 128 experts of 768, 8 a token, bf16, TP1, random weights) runs at 1, 8 and 64 tokens
(decode; 256 and a 2048-token prefill chunk without --quick) through the router, the routing and:
- ``fused``: ``pat_kernels/fused_moe.py`` (``PAT_FUSED_MOE`` auto, what a fast-mode CUDA engine runs), eagerly
  and, at decode sizes, replayed from a CUDA graph captured over the same input buffer (what the engine's
  decode graphs run);
- ``per expert``: ``PAT_FUSED_MOE=off`` (the routing read on the host, five kernels an expert with rows).
GPU time from CUDA events, calls interleaved, median (the per-expert path's host read drains the stream, so
its time includes its launches, as an eager step's would). The floor: the bytes of the experts the routing
touches (each touched expert's three matrices) over the measured copy bandwidth. The outputs are compared
(bf16: within rounding).
"""

from __future__ import annotations

import torch

from common import markdown_table
from gpucheck.report import PartResult
from gpucheck.shared import Ctx, env_switches, log, measure_copy_bandwidth, median, time_interleaved, verdict
from pat_engine.model.arch import arch_from_hf_config
from pat_engine.tiny_model import TinyModelSpec, hf_config

QWEN3_30B_A3B = TinyModelSpec(arch="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                              num_layers=1, num_heads=32, num_kv_heads=4, head_dim=128, max_position=8192,
                              num_experts=128, experts_per_token=8, moe_intermediate_size=768, seed=30)
SMOKE_MOE = TinyModelSpec(arch="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1,
                          num_heads=4, num_kv_heads=2, max_position=512, num_experts=8, experts_per_token=2,
                          moe_intermediate_size=32, seed=30)


def build_layer(spec: TinyModelSpec, fused: bool, device: str, dtype: torch.dtype):
    """Layer 0's ``SparseMoE`` with random weights (the same for both paths: seeded)."""
    from pat_engine.model.layers.moe import SparseMoE

    with env_switches({"PAT_FUSED_MOE": "on" if fused else "off"}):  # on: CUDA, or the CPU's interpreter (smoke)
        layer = SparseMoE(arch_from_hf_config(hf_config(spec)), 1, dtype, device, None)
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_((torch.randn(p.shape, generator=gen, device=device) * 0.02).to(dtype))
    if fused:
        layer.refresh_tables()
    assert layer.fused == fused, "PAT_FUSED_MOE did not decide the path"
    return layer


def touched_bytes(layer, x: torch.Tensor) -> int:
    """Bytes of the experts the routing of ``x`` touches (gate/up and down of each)."""
    from pat_engine.model.layers.moe import route

    experts = route(layer.gate(x), layer.spec)[1].unique().tolist()
    return sum(p.numel() * p.element_size() for e in experts for p in layer.experts[e].parameters())


def graphed(layer, x: torch.Tensor, group):
    """The fused layer captured in a CUDA graph over ``x``'s buffer: (replay, its output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x, group)  # warm-up off the capture (Triton compiles, allocator pools)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x, group)
    return graph.replay, out


def run(ctx: Ctx) -> PartResult:
    from pat_engine.parallel.comm import TPGroup

    spec = SMOKE_MOE if ctx.smoke else QWEN3_30B_A3B
    device, dtype = ctx.device, ctx.dtype
    group = TPGroup(rank=0, size=1, ranks=(0,))
    sizes = (1, 8) if ctx.smoke else (1, 8, 64) if ctx.quick else (1, 8, 64, 256, 2048)
    repeats, warmup = (1, 0) if ctx.smoke else (20, 3)
    bandwidth = None if ctx.smoke else measure_copy_bandwidth(device, 1 << 30)
    fused, per_expert = build_layer(spec, True, device, dtype), build_layer(spec, False, device, dtype)
    rows, data = [], []
    for tokens in sizes:
        gen = torch.Generator(device=device).manual_seed(tokens)
        x = torch.randn(tokens, spec.hidden_size, generator=gen, device=device).to(dtype)
        with torch.inference_mode():
            fns = {"fused": lambda: fused(x, group), "per expert": lambda: per_expert(x, group)}
            ref = per_expert(x, group).float()
            diff = (fused(x, group).float() - ref).abs().max().item() / (ref.abs().max().item() or 1.0)
            if device == "cuda" and tokens <= 256:
                replay, _ = graphed(fused, x, group)
                fns["fused, graph"] = replay
            times = {n: median(t) for n, t in time_interleaved(fns, repeats, warmup, device).items()}
            nbytes = touched_bytes(fused, x)
        floor = nbytes / bandwidth if bandwidth else None
        best = min(times[n] for n in times if n != "per expert")
        data.append({"tokens": tokens, "ms": {n: t * 1e3 for n, t in times.items()}, "touched_bytes": nbytes,
                     "floor_ms": floor * 1e3 if floor else None, "max_rel_diff": diff})
        rows.append([tokens, f"{nbytes / 1e6:.0f}"] + [f"{times[n] * 1e3:.3f}" if n in times else "-"
                                                         for n in ("per expert", "fused", "fused, graph")]
                    + [f"{times['per expert'] / best:.1f}x", f"{floor * 1e3:.3f}" if floor else "-",
                       f"{best / floor:.2f}x" if floor else "-", f"{diff:.1e}"])
        log(f"moe: {tokens} tokens: {rows[-1]}")
    decode = [d for d in data if d["tokens"] <= 64]
    ok = all(d["max_rel_diff"] < 3e-2 for d in data)
    headlines = [f"MoE layer (Qwen3-30B-A3B shape, bf16): fused {min(d['ms']['fused'], d['ms'].get('fused, graph', 1e9)):.3f} ms "
                 f"vs per expert {d['ms']['per expert']:.3f} ms at {d['tokens']} tokens" for d in decode[:1]]
    headlines.append(f"fused = per expert within bf16 rounding: {verdict(ok)}")
    body = (f"{spec.num_experts} experts of {spec.moe_intermediate_size}, {spec.experts_per_token} a token, hidden "
            f"{spec.hidden_size}, {str(dtype).removeprefix('torch.')}, TP1; GPU ms per call (router included), "
            f"median of {repeats}, interleaved; floor: touched experts' bytes / copy bandwidth"
            + (f" ({bandwidth / 1e12:.2f} TB/s)" if bandwidth else "") + ".\n\n"
            + markdown_table(["tokens", "touched MB", "per expert ms", "fused ms", "fused, graph ms",
                              "per expert / best fused", "floor ms", "best fused / floor", "max rel diff"], rows))
    return PartResult(body, headlines, {"cases": data})
