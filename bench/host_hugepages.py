"""CPU workers whose large buffers get transparent huge pages, against 4 KiB pages, on RL rollouts.

glibc maps every buffer above 32 MiB afresh and unmaps it on free, so a decode step's logits (58 MB
at batch 96 and Qwen's 151,936-token vocabulary) are faulted in page by page every step. The
engine starts its CPU workers with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (EngineConfig.worker_env)
unless the environment sets ``GLIBC_TUNABLES``: ``huge`` runs with the engine's setting,
``4k`` with ``glibc.malloc.hugetlb=0``. Each run starts its own engine (workers read it when they
start), warms it up, then times one whole rollout; runs alternate (huge, 4k, huge, 4k, ...). The
workloads are bench/peer_rollout.py's, at TP1 float32; the workers' minor page faults per run are
reported too.

    python bench/host_hugepages.py          # writes bench/results/host_hugepages.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result  # noqa: E402
from peer_rollout import SHAPES, PatRollout, Workload, model_path, workloads  # noqa: E402


def minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


SETTINGS = {"huge": {"GLIBC_TUNABLES": None}, "4k": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}}  # None: unset


def one_run(path: str, env: dict[str, str | None], w: Workload, dtype: str = "float32"
            ) -> tuple[float, int, list[list[int]]]:
    """One rollout on an engine started with ``env`` set (None: unset); (seconds, worker faults, tokens)."""
    for name, value in env.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value
    pat = PatRollout(path, dtype)
    pat.start()
    try:
        pat.run(Workload("warm-up", w.prompts[:4], [8] * 4))
        pids = pat.engine.worker_pids()
        before = sum(minor_faults(p) for p in pids)
        seconds, tokens = pat.run(w)
        return seconds, sum(minor_faults(p) for p in pids) - before, tokens
    finally:
        pat.close()


def alternating(path: str, settings: dict[str, dict[str, str | None]], w: Workload, rounds: int,
                dtype: str = "float32") -> tuple[dict[str, float], dict[str, float], bool]:
    """``rounds`` runs per setting, alternating; (median seconds, median faults, same tokens) per setting."""
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in settings}
    tokens = {}
    for _ in range(rounds):
        for name, env in settings.items():
            t = time.perf_counter()
            seconds, faults, tokens[name] = one_run(path, env, w, dtype)
            runs[name].append((seconds, faults))
            print(f"{w.name} {name}: {seconds:.2f} s, {faults} faults ({time.perf_counter() - t:.0f} s with start)",
                  flush=True)
    seconds = {name: statistics.median(s for s, _ in r) for name, r in runs.items()}
    faults = {name: statistics.median(f for _, f in r) for name, r in runs.items()}
    return seconds, faults, len({str(t) for t in tokens.values()}) == 1


def ab_args(description: str) -> argparse.Namespace:
    """The A/B benches' command line: ``--rounds`` per setting, ``--shapes`` of peer_rollout's models."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    return ap.parse_args()


def ab_cases(shapes: list[str], top_p: bool = False, tail: bool = False) -> Iterator[tuple[str, str, Workload]]:
    """(shape, model path, workload) for each shape's first two workloads: the greedy tail, GRPO top_p 1.0;
    ``top_p``: also the third, GRPO top_p 0.95; ``tail``: also the last requests of a long tail alone (two
    greedy responses of 256 and 640 tokens: steps of two rows, then of one)."""
    for shape in shapes:
        path = model_path(shape)
        loads = workloads(SHAPES[shape].vocab_size, seed=7)
        if tail:
            loads.append(Workload("tail alone: 2 requests, greedy, 256 + 640 tokens", loads[0].prompts[:2], [256, 640]))
        for w in loads[: 3 if top_p else 2] + loads[3:]:
            yield shape, path, w


def main() -> None:
    args = ab_args(__doc__.split("\n\n")[0])
    rows = []
    for shape, path, w in ab_cases(args.shapes):
        seconds, faults, same = alternating(path, SETTINGS, w, args.rounds)
        rows.append([shape, w.name, f"{seconds['4k']:.2f}", f"{seconds['huge']:.2f}",
                     f"{seconds['4k'] / seconds['huge']:.2f}x", faults["4k"], faults["huge"], "yes" if same else "NO"])
    body = (f"Median of {args.rounds} alternating runs per setting, each on a freshly started engine (TP1, float32), "
            "seconds from submitting the rollout to its last token; faults: the worker's minor page faults "
            "during the run.\n\n"
            + markdown_table(["model", "workload", "4 KiB pages s", "huge pages s", "speed-up",
                              "faults 4 KiB", "faults huge", "same tokens"], rows))
    write_result("host_hugepages", "Huge pages for the CPU workers' large buffers (glibc.malloc.hugetlb)", body)


if __name__ == "__main__":
    main()
