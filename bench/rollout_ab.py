"""Engine settings side by side on RL rollouts: each run starts its own engine with a setting's environment
(workers read it when they start), warms it up and times whole rollouts of bench/peer_rollout.py's workloads;
runs alternate setting by setting. The A/B benches (bf16_packing.py, worker_malloc.py, rollout_tree_ab.py)
share these helpers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import rss_bytes  # noqa: E402
from peer_rollout import SHAPES, PatRollout, Workload, model_path, workloads  # noqa: E402


def minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


@dataclass(frozen=True)
class Runs:
    """One engine's timed rollouts of one workload: seconds of each (the first on a fresh engine after a short
    warm-up, the rest as a long-lived engine runs them), the workers' minor page faults over all of them and
    their resident memory after the last."""

    seconds: list[float]
    faults: int
    rss: int
    tokens: list[list[int]]


def one_engine(path: str, env: dict[str, str | None], w: Workload, dtype: str = "float32", repeats: int = 1) -> Runs:
    """``repeats`` rollouts of ``w`` on an engine started with ``env`` set (None: unset)."""
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
        seconds, tokens = [], []
        for _ in range(repeats):
            s, tokens = pat.run(w)
            seconds.append(s)
        return Runs(seconds, sum(minor_faults(p) for p in pids) - before, sum(rss_bytes(p) for p in pids), tokens)
    finally:
        pat.close()


def alternating(path: str, settings: dict[str, dict[str, str | None]], w: Workload, rounds: int,
                dtype: str = "float32", repeats: int = 1) -> tuple[dict[str, list[Runs]], bool]:
    """``rounds`` engines per setting, alternating, each timing ``repeats`` rollouts: the runs per setting and
    whether every run gave the same tokens."""
    runs: dict[str, list[Runs]] = {name: [] for name in settings}
    for _ in range(rounds):
        for name, env in settings.items():
            t = time.perf_counter()
            r = one_engine(path, env, w, dtype, repeats)
            runs[name].append(r)
            print(f"{w.name} {name}: {' '.join(f'{s:.2f}' for s in r.seconds)} s, {r.faults} faults, "
                  f"{r.rss / 2**20:.0f} MiB ({time.perf_counter() - t:.0f} s with start)", flush=True)
    same = len({str(r.tokens) for rs in runs.values() for r in rs}) == 1
    return runs, same


def median_seconds(runs: list[Runs], which: slice = slice(None)) -> float:
    """The median over engines of the rollouts ``which`` selects (all, the first, the later ones)."""
    return statistics.median(s for r in runs for s in r.seconds[which])


def ab_args(description: str, repeats: int = 1,
            settings: tuple[list[str], list[str]] | None = None) -> argparse.Namespace:
    """The A/B benches' command line: ``--rounds`` per setting, ``--shapes`` of peer_rollout's models,
    ``--repeats`` rollouts per engine; ``settings`` (choices, default): a ``--settings`` option too."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=repeats)
    if settings is not None:
        ap.add_argument("--settings", nargs="+", choices=settings[0], default=settings[1])
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
