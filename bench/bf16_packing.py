"""bfloat16 GEMM weights packed for oneDNN (model/cpu_gemm.py) against plain ``F.linear``, on RL rollouts.

On a CPU with native bfloat16 dot products (AVX512-BF16 here) the engine packs bfloat16 weights as it
packs float32 ones; ``PAT_CPU_GEMM=torch`` turns packing off. Each run starts its own engine (TP1,
bfloat16), warms it up and times one whole rollout of bench/peer_rollout.py's workloads; runs
alternate (packed, plain, packed, plain, ...).

    python bench/bf16_packing.py            # writes bench/results/bf16_packing.md
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from rollout_ab import ab_args, ab_cases, alternating, median_seconds  # noqa: E402

SETTINGS = {"packed": {"PAT_CPU_GEMM": None}, "plain": {"PAT_CPU_GEMM": "torch"}}


def main() -> None:
    args = ab_args(__doc__.split("\n\n")[0])
    rows = []
    for shape, path, w in ab_cases(args.shapes):
        runs, same = alternating(path, SETTINGS, w, args.rounds, "bfloat16")
        seconds = {name: median_seconds(r) for name, r in runs.items()}
        rows.append([shape, w.name, f"{seconds['plain']:.2f}", f"{seconds['packed']:.2f}",
                     f"{seconds['plain'] / seconds['packed']:.2f}x", "yes" if same else "no"])
    body = (f"Median of {args.rounds} alternating runs per setting, each on a freshly started engine (TP1, "
            "bfloat16), seconds from submitting the rollout to its last token. `same tokens`: in bfloat16 the "
            "packed and the plain GEMM may round differently, so a near-tie can flip a token.\n\n"
            + markdown_table(["model", "workload", "plain s", "packed s", "speed-up", "same tokens"], rows))
    write_result("bf16_packing", "oneDNN-packed bfloat16 GEMM weights on the CPU", body)


if __name__ == "__main__":
    main()
