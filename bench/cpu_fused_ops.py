"""The CPU RMSNorm and rotary kernels against the torch formulas they replace, in a whole decode step.

    PYTHONPATH=.:profiler:integrations:csrc python bench/cpu_fused_ops.py [--rounds 15] [--threads 2]

One decode step of the benchmark model (bench/common.PEER_SPEC, float32, greedy, in process) is
timed with both kernels on, with each one off (``PAT_CPU_NORM=torch``, ``PAT_CPU_ROTARY=torch``)
and with both off. The four settings take turns step by step, the order reversed every round, so
the shared host's load hits them alike; medians are reported. A step has 2 * layers + 1 = 9 norms
(8 fused with the residual add) and 4 rotary passes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PEER_SPEC, markdown_table, write_result  # noqa: E402
from step_breakdown import Rollout  # noqa: E402
from pat_engine.tiny_model import write_tiny_model  # noqa: E402
from pat_kernels import cpu_extension, cpu_norm, cpu_rotary  # noqa: E402

SETTINGS = {  # name -> (norm path, rotary path)
    "both kernels": ("kernel", "kernel"),
    "norm off": ("torch", "kernel"),
    "rotary off": ("kernel", "torch"),
    "both off": ("torch", "torch"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps-per-turn", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_extension.load():
        sys.exit(f"the CPU extension cannot be built: {cpu_extension._failed}")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_tiny_model(Path(tmp), PEER_SPEC)
        for batch in args.batch_sizes:
            run = Rollout(tmp, batch, 32, len(SETTINGS) * args.rounds * args.steps_per_turn + 8, sampled=False)
            run.prefill()
            for _ in range(4):
                run.decode()
            times: dict[str, list[float]] = {name: [] for name in SETTINGS}
            for r in range(args.rounds):
                for name in list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]:
                    os.environ[cpu_norm.ENV_SWITCH], os.environ[cpu_rotary.ENV_SWITCH] = SETTINGS[name]
                    start = time.perf_counter()
                    for _ in range(args.steps_per_turn):
                        run.decode()
                    times[name].append((time.perf_counter() - start) / args.steps_per_turn * 1e3)
            m = {name: statistics.median(v) for name, v in times.items()}
            base = m["both kernels"]
            rows.append([batch] + [round(m[name], 2) for name in SETTINGS]
                        + [f"{m['both off'] / base:.2f}x", round(m["both off"] - base, 2)])
    for switch in (cpu_norm.ENV_SWITCH, cpu_rotary.ENV_SWITCH):
        os.environ.pop(switch, None)
    body = (f"float32, {args.threads} torch threads, one decode step in process (context grows from 36), "
            f"median ms over {args.rounds} rounds of {args.steps_per_turn} steps per setting. "
            f"Load average at the end: {os.getloadavg()[0]:.2f}.\n\n"
            + markdown_table(["batch"] + [f"{name} ms" for name in SETTINGS] + ["both off / both kernels", "saved ms"], rows))
    write_result("cpu_fused_ops", "CPU RMSNorm and rotary kernels vs the torch formulas, per decode step", body)


if __name__ == "__main__":
    main()
