"""bfloat16 GEMM weights packed for oneDNN (model/cpu_gemm.py) against plain ``F.linear``, on RL rollouts.

On a CPU with native bfloat16 dot products (AVX512-BF16 here) the engine packs bfloat16 weights as it
packs float32 ones; ``PAT_CPU_GEMM=torch`` turns packing off. Each run starts its own engine (TP1,
bfloat16), warms it up and times one whole rollout of bench/peer_rollout.py's workloads; runs
alternate (packed, plain, packed, plain, ...).

    python bench/bf16_packing.py            # writes bench/results/bf16_packing.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from host_hugepages import alternating  # noqa: E402
from peer_rollout import SHAPES, model_path, workloads  # noqa: E402

SETTINGS = {"packed": {"PAT_CPU_GEMM": None}, "plain": {"PAT_CPU_GEMM": "torch"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        path = model_path(shape)
        for w in workloads(SHAPES[shape].vocab_size, seed=7)[:2]:  # greedy tail, GRPO top_p 1.0
            seconds, _, same = alternating(path, SETTINGS, w, args.rounds, "bfloat16")
            rows.append([shape, w.name, f"{seconds['plain']:.2f}", f"{seconds['packed']:.2f}",
                         f"{seconds['plain'] / seconds['packed']:.2f}x", "yes" if same else "no"])
    body = (f"Median of {args.rounds} alternating runs per setting, each on a freshly started engine (TP1, "
            "bfloat16), seconds from submitting the rollout to its last token. `same tokens`: in bfloat16 the "
            "packed and the plain GEMM may round differently, so a near-tie can flip a token.\n\n"
            + markdown_table(["model", "workload", "plain s", "packed s", "speed-up", "same tokens"], rows))
    write_result("bf16_packing", "oneDNN-packed bfloat16 GEMM weights on the CPU", body)


if __name__ == "__main__":
    main()
