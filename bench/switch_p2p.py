"""A switch's point-to-point path on CPU workers: sent directly (gloo, the CPU default) against by handle
(shared-memory files, the protocol ranks sharing a GPU use with CUDA IPC; parallel/p2p.py).

Two measurements, side by side in one run, interleaved (A, B, A, B):

1. ``Engine.measure_bandwidth`` along each path at 1, 8 and 64 MiB (every rank sending to the next at
   once), on one engine: the same processes, the path asked per probe.
2. The switch of bench/switch_overhead.py (TP2xDP2 -> TP4xDP1, requests at ~1024 tokens of context,
   KV migrated) on an engine per path (the path is the workers' ``PAT_SWITCH_P2P``, read at start), the
   engines built in turn: weights, KV and total seconds, median over the rounds.

This decides the CPU default (``PAT_SWITCH_P2P=auto`` keeps gloo on the CPU): the handle path earns its
place where the alternative is staging through the host (ranks sharing a GPU), not where gloo already
moves host memory.

    python bench/switch_p2p.py [--rounds 3] [--requests 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from common import markdown_table, write_result
from pat_engine import Engine
from pat_engine.tiny_model import write_tiny_model
from switch_overhead import SPEC, prompts_for, switched_run

PATHS = ("direct", "handles")
PROBE_MIB = (1, 8, 64)
KV_BYTES = 256 << 20


def probe_rows(path: str, rounds: int) -> list[list]:
    """GB/s a rank along each path at each probe size, best of ``rounds`` interleaved probes of 3."""
    best = {(p, mib): 0.0 for p in PATHS for mib in PROBE_MIB}
    with Engine(path, tp=2, dp=2, dtype="float32", kv_cache_bytes=KV_BYTES) as engine:
        for _ in range(rounds):
            for mib in PROBE_MIB:
                for p in PATHS:
                    best[p, mib] = max(best[p, mib], engine.measure_bandwidth(mib << 20, path=p))
    return [[mib, *(best[p, mib] / 1e9 for p in PATHS), best["handles", mib] / best["direct", mib]]
            for mib in PROBE_MIB]


def switch_costs(path: str, p2p: str, requests: int) -> dict[str, float]:
    """One engine whose workers take ``p2p``: the headline switch's weights, KV and total seconds."""
    os.environ["PAT_SWITCH_P2P"] = p2p  # the workers read it when they exchange (they inherit it)
    try:
        with Engine(path, tp=2, dp=2, dtype="float32", kv_cache_bytes=KV_BYTES) as engine:
            switched_run(engine, prompts_for(4, 64, 0), 2, 4, "migrate", 2, 4)  # warm-up: groups, first exchanges
            event, _, _ = switched_run(engine, prompts_for(requests, 1024, 1), 2, 4, "migrate", 4, 8)
    finally:
        os.environ.pop("PAT_SWITCH_P2P", None)
    c = event.costs
    return {"weights": c["weights_s"], "kv": c["kv_s"], "total": event.seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=9)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_tiny_model(tmp, SPEC))
        probes = probe_rows(path, args.rounds)
        runs: dict[str, list[dict]] = {p: [] for p in PATHS}
        for _ in range(args.rounds):
            for p in PATHS:
                runs[p].append(switch_costs(path, p, args.requests))
    medians = {p: {k: statistics.median(r[k] for r in v) for k in ("weights", "kv", "total")} for p, v in runs.items()}
    switch_rows = [[k, medians["direct"][k], medians["handles"][k], medians["handles"][k] / medians["direct"][k]]
                   for k in ("weights", "kv", "total")]
    body = (
        f"CPU worker processes, 4 ranks, the model of bench/switch_overhead.py (hidden {SPEC.hidden_size}, "
        f"{SPEC.num_layers} layers, float32).\n\n"
        f"**Point-to-point per rank** (one engine, the path asked per probe, best of {args.rounds} interleaved "
        f"rounds of 3):\n\n"
        + markdown_table(["MiB a rank", "direct GB/s", "by handle GB/s", "handle / direct"], probes)
        + f"\n\n**The switch TP2xDP2 -> TP4xDP1** ({args.requests} requests at ~1024 tokens of context, KV "
        f"migrated; an engine per path, built in turn, median of {args.rounds}):\n\n"
        + markdown_table(["seconds", "direct", "by handle", "handle / direct"], switch_rows)
        + "\n\nPer round (weights / KV / total s): "
        + "; ".join(f"{p}: " + ", ".join(f"{r['weights']:.3f} / {r['kv']:.3f} / {r['total']:.3f}" for r in v)
                    for p, v in runs.items())
        + ".\n"
    )
    write_result("switch_p2p", "A switch's point-to-point path on CPU workers: direct vs by handle", body)


if __name__ == "__main__":
    main()
