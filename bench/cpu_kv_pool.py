"""The CPU engine's default KV pool against the fixed 64 MiB it replaced, on the peer benchmark's batch.

    PYTHONPATH=.:profiler:integrations:csrc python bench/cpu_kv_pool.py [--rounds 4] [--batch-sizes 64]

A TP1 engine (bench/common.PEER_SPEC, float32) generates 128 greedy tokens for each of ``batch``
32-token prompts, once with the default pool (core/memory.default_cpu_kv_bytes) and once with
``kv_cache_bytes=64 MiB``, the old default, which holds 8192 tokens of this checkpoint. The two
alternate round by round (order reversed every round), each in a fresh engine. Reported: output
tokens/s (median) and the steps the call took (prefill + decode): a batch the pool cannot hold at
once runs in waves.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from peer_cpu import model_path  # noqa: E402
from step_breakdown import driver_row  # noqa: E402

OLD_DEFAULT = 64 << 20
POOLS = {"default": None, "64 MiB (old default)": OLD_DEFAULT}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[64])
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    rows = []
    for batch in args.batch_sizes:
        rates: dict[str, list[float]] = {name: [] for name in POOLS}
        steps: dict[str, str] = {}
        for r in range(args.rounds):
            for name in list(POOLS) if r % 2 == 0 else list(POOLS)[::-1]:
                run = argparse.Namespace(prompt_len=32, new_tokens=args.new_tokens, threads=2, kv_cache_bytes=POOLS[name])
                d = driver_row(model_path(), batch, run)
                rates[name].append(d["tok/s"])
                steps[name] = d["steps"]
                print(f"round {r} {name} batch {batch}: {d['tok/s']:.0f} tok/s, steps {d['steps']}", flush=True)
        med = {name: statistics.median(v) for name, v in rates.items()}
        rows.append([batch] + [f"{med[n]:.0f} ({steps[n]})" for n in POOLS]
                    + [f"{med['default'] / med['64 MiB (old default)']:.2f}x"])
    body = (f"TP1, float32, 2 threads, prompt 32, {args.new_tokens} new tokens, greedy; median of {args.rounds} "
            f"interleaved rounds. Load average at the end: {os.getloadavg()[0]:.2f}.\n\n"
            + markdown_table(["batch"] + [f"{n}: tok/s (prefill + decode steps)" for n in POOLS] + ["default / 64 MiB"], rows))
    write_result("cpu_kv_pool", "CPU KV pool: the memory-sized default vs the old fixed 64 MiB", body)


if __name__ == "__main__":
    main()
