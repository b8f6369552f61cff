"""Why CPU float32 GEMM weights are packed for oneDNN: ``F.linear`` vs the packed product, per layer shape.

    python bench/cpu_gemm_packed.py [--threads 2] [--rounds 5]

The shapes are one decoder layer of the peer benchmark's checkpoint (hidden 512, 8 heads / 4 KV
heads, intermediate 1536) plus its LM head (vocab 8192), at the decode batch sizes of
bench/peer_cpu.py. Each round times the plain and the packed product back to back (A, B, A, B),
so load from other jobs hits both alike; the table gives the median over rounds and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from common import PEER_SPEC, markdown_table, write_result
from pat_engine.model import cpu_gemm

_HD = PEER_SPEC.hidden_size // PEER_SPEC.num_heads
SHAPES = {  # (out, in) of each GEMM weight at TP1
    "qkv_proj": ((PEER_SPEC.num_heads + 2 * PEER_SPEC.num_kv_heads) * _HD, PEER_SPEC.hidden_size),
    "o_proj": (PEER_SPEC.hidden_size, PEER_SPEC.num_heads * _HD),
    "gate_up_proj": (2 * PEER_SPEC.intermediate_size, PEER_SPEC.hidden_size),
    "down_proj": (PEER_SPEC.hidden_size, PEER_SPEC.intermediate_size),
    "lm_head": (PEER_SPEC.vocab_size, PEER_SPEC.hidden_size),
}
LAYERS = PEER_SPEC.num_layers


def per_call_ms(fn, calls: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows, model_rows = [], []
    for batch in args.batch_sizes:
        step = [0.0, 0.0]  # plain, packed ms of one decode step's GEMMs
        for name, (out_features, in_features) in SHAPES.items():
            module = torch.nn.Module()
            module.weight = torch.nn.Parameter(torch.randn(out_features, in_features), requires_grad=False)
            module.is_gemm_weight = True
            cpu_gemm.pack(module)
            w, x = module.weight, torch.randn(batch, in_features)
            torch.testing.assert_close(cpu_gemm.packed_linear(x, w, None), F.linear(x, w), rtol=1e-4, atol=1e-3)
            calls = max(20, 2000 // batch)
            plain, packed = [], []
            for _ in range(args.rounds):
                plain.append(per_call_ms(lambda: F.linear(x, w), calls))
                packed.append(per_call_ms(lambda: cpu_gemm.packed_linear(x, w, None), calls))
            p, q = statistics.median(plain), statistics.median(packed)
            per_step = 1 if name == "lm_head" else LAYERS
            step = [step[0] + per_step * p, step[1] + per_step * q]
            rows.append([batch, name, f"{out_features}x{in_features}", round(p, 4), round(q, 4), f"{p / q:.2f}x"])
        model_rows.append([batch, round(step[0], 3), round(step[1], 3), f"{step[0] / step[1]:.2f}x"])
    body = (f"float32, {args.threads} torch threads, median of {args.rounds} interleaved rounds; "
            f"oneDNN available: {torch.backends.mkldnn.is_available()}.\n\n"
            + markdown_table(["rows", "layer", "weight", "F.linear ms", "packed ms", "plain / packed"], rows)
            + "\n\nWhole model (4 layers + LM head), GEMM ms per decode step:\n\n"
            + markdown_table(["rows", "F.linear ms", "packed ms", "plain / packed"], model_rows))
    write_result("cpu_gemm_packed", "CPU GEMM: plain F.linear vs oneDNN-packed weights", body)


if __name__ == "__main__":
    main()
