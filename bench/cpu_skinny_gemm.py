"""The CPU GEMM of decode steps of a few rows: the skinny kernel against oneDNN's packed GEMM.

A long-tail decode step multiplies one or two rows per DP group by every weight matrix: it streams the
weights. For each weight shape of bench/peer_rollout.py's two models (h768: hidden 768, intermediate 2048,
vocab 16,384; qwen-vocab: hidden 512, intermediate 1408, vocab 151,936), float32 and bfloat16, and 1 to 8
rows, this times ``pat_kernels/cpu/skinny_gemm.cpp`` and the oneDNN pack the engine uses otherwise
(``model/cpu_gemm.py``), interleaved (oneDNN, skinny, oneDNN, ...). Each timed call walks a set of copies of
the weight about 200 MB large, so the weights come from memory as in a decode step, not from the cache.
GB/s = weight bytes / time; ``torch.sum`` over the same copies is the read bandwidth beside them.

    python bench/cpu_skinny_gemm.py            # writes bench/results/cpu_skinny_gemm.md
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import markdown_table, write_result
from pat_kernels import cpu_extension, cpu_skinny_gemm

from pat_engine.model import cpu_gemm

SHAPES = {  # (out, in) of each linear layer, fused as the engine fuses them
    "h768 qkv": (1024, 768), "h768 o": (768, 768), "h768 gate_up": (4096, 768), "h768 down": (768, 2048),
    "h768 LM head": (16384, 768),
    "qwen-vocab gate_up": (2816, 512), "qwen-vocab down": (512, 1408), "qwen-vocab LM head": (151936, 512),
}
SET_BYTES = 200e6


def per_call(fn, weights: list[torch.Tensor]) -> float:
    """Seconds per weight, one call on each copy in turn."""
    t = time.perf_counter()
    for w in weights:
        fn(w)
    return (time.perf_counter() - t) / len(weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_extension.load():
        raise SystemExit(f"the CPU kernels are not built: {cpu_extension._failed}")
    rows_out = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (out, inp) in SHAPES.items():
            copies = max(2, int(SET_BYTES // (out * inp * dtype.itemsize)))
            weights = [torch.randn(out, inp).to(dtype) for _ in range(copies)]
            packs = {id(w): torch.ops.mkldnn._reorder_linear_weight(w) for w in weights}
            nbytes = out * inp * dtype.itemsize
            read = min(per_call(lambda w: w.sum(), weights) for _ in range(3))
            for rows in args.rows:
                x = torch.randn(rows, inp).to(dtype)
                paths = {"oneDNN": lambda w, x=x, packs=packs: torch.ops.mkldnn._linear_pointwise(
                             x, packs[id(w)], None, "none", [], ""),
                         "skinny": lambda w, x=x: cpu_skinny_gemm.linear(x, w, None)}
                times = {k: [] for k in paths}
                for _ in range(args.rounds):
                    for k, fn in paths.items():
                        times[k].append(per_call(fn, weights))
                one, skinny = (statistics.median(times[k]) for k in ("oneDNN", "skinny"))
                rows_out.append([str(dtype).removeprefix("torch."), name, rows, f"{one * 1e6:.0f}",
                                 f"{skinny * 1e6:.0f}", f"{nbytes / one / 1e9:.1f}", f"{nbytes / skinny / 1e9:.1f}",
                                 f"{nbytes / read / 1e9:.1f}", f"{one / skinny:.2f}x"])
                print(rows_out[-1], flush=True)
    body = (f"{args.threads} torch threads; median of {args.rounds} interleaved rounds, each one call per weight copy "
            f"over about {SET_BYTES / 1e6:.0f} MB of copies. The engine takes the skinny kernel for fast-mode steps of up "
            f"to `SKINNY_ROWS` rows (`model/cpu_gemm.py`): "
            + ", ".join(f"{str(d).removeprefix('torch.')} {n}" for d, n in cpu_gemm.SKINNY_ROWS.items()) + ".\n\n"
            + markdown_table(["dtype", "weight", "rows", "oneDNN us", "skinny us", "oneDNN GB/s", "skinny GB/s",
                              "torch.sum GB/s", "oneDNN / skinny"], rows_out))
    write_result("cpu_skinny_gemm", "The CPU GEMM of decode steps of a few rows: skinny kernel vs oneDNN", body)


if __name__ == "__main__":
    main()
