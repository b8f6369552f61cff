"""How many tokens a CPU prefill step takes at most (``max_num_batched_tokens``), on whole RL rollouts.

bench/peer_rollout.py's ``h768`` shape and its first two workloads (the greedy long tail: 96 prompts of 16-256
tokens, prefill-heavy; GRPO 12x8 at temperature 1, decode-heavy), one engine per setting (TP1, started once),
runs interleaved setting by setting, each after the engine dropped its prefix cache (untimed). A prefill step of
8192 tokens makes 134 MB activations (gate/up: 8192 x 4096 float32), each mapped afresh and faulted in by glibc
(above its 32 MiB mmap threshold) and read back from memory rather than cache.

    python bench/cpu_prefill_chunk.py            # writes bench/results/cpu_prefill_chunk.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from peer_rollout import MAX_LEN, SHAPES, model_path, workloads  # noqa: E402

from pat_engine import Engine, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[8192, 4096, 2048, 1024])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for dtype in args.dtypes:
        loads = workloads(SHAPES["h768"].vocab_size, seed=7)[:2]
        seconds: dict[tuple[int, str], list[float]] = {}
        engines = {c: Engine(model_path("h768"), tp=1, dtype=dtype, max_model_len=MAX_LEN, max_num_batched_tokens=c)
                   for c in args.chunks}
        try:
            for engine in engines.values():
                engine.generate(loads[0].prompts[:4], [SamplingParams(max_new_tokens=8)] * 4, use_tqdm=False)
            for _ in range(args.rounds):
                for w in loads:
                    params = [SamplingParams(max_new_tokens=m, min_new_tokens=m, n=w.n, temperature=w.temperature,
                                             seed=1000 + i, logprobs=w.n > 1) for i, m in enumerate(w.max_tokens)]
                    for chunk, engine in engines.items():
                        engine.flush_cache()
                        t = time.perf_counter()
                        engine.generate(w.prompts, params, use_tqdm=False)
                        seconds.setdefault((chunk, w.name), []).append(time.perf_counter() - t)
                        print(dtype, chunk, w.name, f"{seconds[(chunk, w.name)][-1]:.2f} s", flush=True)
        finally:
            for engine in engines.values():
                engine.shutdown()
        for w in loads:
            base = statistics.median(seconds[(args.chunks[0], w.name)])
            for chunk in args.chunks:
                s = statistics.median(seconds[(chunk, w.name)])
                rows.append([dtype, w.name, chunk, f"{s:.2f}", f"{base / s:.2f}x"])
    body = (f"Median of {args.rounds} rounds, the settings interleaved; seconds from submitting the whole rollout to "
            f"its last token; speed relative to {args.chunks[0]} tokens a prefill step.\n\n"
            + markdown_table(["dtype", "workload", "max tokens a prefill step", "s", "speed"], rows))
    write_result("cpu_prefill_chunk", "CPU prefill step size on whole RL rollouts", body)


if __name__ == "__main__":
    main()
