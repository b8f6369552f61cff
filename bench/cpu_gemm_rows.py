"""Why CPU linear layers pad rows to a multiple of 4: matmul time against row count, plain and padded.

    python bench/cpu_gemm_rows.py [--threads 1] [--dtype float64]

Times ``F.linear`` (x: rows x 2048, weight 6144 x 2048, the benchmark model's MLP shape) with one
torch thread, as a worker has on this machine, and the engine's padded ``linear`` on the same input.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from common import markdown_table, write_result
from pat_engine.model.layers.linear import linear


def best_ms(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    w = torch.randn(6144, 2048, dtype=dtype)
    rows = []
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 15, 16, 31, 32, 61, 64):
        x = torch.randn(m, 2048, dtype=dtype)
        plain, padded = best_ms(lambda: F.linear(x, w)), best_ms(lambda: linear(x, w))
        rows.append([m, f"{plain:.2f}", f"{padded:.2f}", f"{plain / padded:.2f}x"])
    body = (f"`F.linear` vs the engine's row-padded `linear`, {args.dtype}, weight 6144x2048, "
            f"{args.threads} torch thread(s), best of 10.\n\n"
            + markdown_table(["rows", "F.linear ms", "padded linear ms", "plain / padded"], rows))
    write_result("cpu_gemm_rows", "CPU matmul time against row count", body)


if __name__ == "__main__":
    main()
