"""CPU workers reusing freed heap pages (worker/host_memory.py) against glibc's defaults, on RL rollouts.

glibc maps every buffer above 32 MiB afresh and unmaps it on free, so a decode step's logits (58 MB
at batch 96 and Qwen's 151,936-token vocabulary) are faulted in page by page every step.
``PAT_HOST_HEAP=keep`` (the default) keeps freed pages in the heap; ``trim`` is glibc's behaviour.
Each run starts its own engine (workers read the switch when they start), warms it up, then times
one whole rollout; runs alternate (keep, trim, keep, trim, ...). The workloads are
bench/peer_rollout.py's, at TP1 float32; the worker's minor page faults per run are reported too.

    python bench/host_heap.py               # writes bench/results/host_heap.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from peer_rollout import SHAPES, PatRollout, Workload, model_path, workloads  # noqa: E402


def minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def one_run(path: str, heap: str, w: Workload) -> tuple[float, int, list[list[int]]]:
    os.environ["PAT_HOST_HEAP"] = heap
    pat = PatRollout(path)
    pat.start()
    try:
        pat.run(Workload("warm-up", w.prompts[:4], [8] * 4))
        pids = pat.engine.worker_pids()
        before = sum(minor_faults(p) for p in pids)
        seconds, tokens = pat.run(w)
        return seconds, sum(minor_faults(p) for p in pids) - before, tokens
    finally:
        pat.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        path = model_path(shape)
        for w in workloads(SHAPES[shape].vocab_size, seed=7)[:2]:  # greedy tail, GRPO top_p 1.0
            runs: dict[str, list[tuple[float, int]]] = {"keep": [], "trim": []}
            tokens = {}
            for _ in range(args.rounds):
                for heap in runs:
                    t = time.perf_counter()
                    seconds, faults, tokens[heap] = one_run(path, heap, w)
                    runs[heap].append((seconds, faults))
                    print(f"{shape} {w.name} {heap}: {seconds:.2f} s, {faults} faults "
                          f"({time.perf_counter() - t:.0f} s with start)", flush=True)
            keep = statistics.median(s for s, _ in runs["keep"])
            trim = statistics.median(s for s, _ in runs["trim"])
            rows.append([shape, w.name, f"{trim:.2f}", f"{keep:.2f}", f"{trim / keep:.2f}x",
                         statistics.median(f for _, f in runs["trim"]), statistics.median(f for _, f in runs["keep"]),
                         "yes" if tokens["keep"] == tokens["trim"] else "NO"])
    body = (f"Median of {args.rounds} alternating runs per setting, each on a freshly started engine (TP1, float32), "
            "seconds from submitting the rollout to its last token; faults: the worker's minor page faults "
            "during the run.\n\n"
            + markdown_table(["model", "workload", "glibc default s", "keep heap s", "speed-up",
                              "faults default", "faults keep", "same tokens"], rows))
    write_result("host_heap", "Reusing freed heap pages in CPU workers (PAT_HOST_HEAP)", body)


if __name__ == "__main__":
    main()
