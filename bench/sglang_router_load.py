"""Load through sglang-router: 2 pat-serve instances behind it vs 1, loopback, bounded time, none lost.

Starts two ``pat-serve serve`` processes (each ``--world 1``) and one
``sglang-router`` (round robin) in front of both, on ports the OS picks. Rounds
alternate the router's worker set, 1 worker, 2 workers, 1, 2, ... (the second
instance is removed and added again through the router's ``/workers`` API), so
both configurations see the same machine state, interleaved. In each round
``--clients`` clients send SGLang ``/generate`` requests back to back for
``--duration`` seconds (greedy, EOS ignored, so every answer's length is
known). Every request carries a unique ``rid`` and a nonce prompt; each answer
must come back once, complete, with the asked length: lost = sent - good.

    PYTHONPATH=.:profiler python bench/sglang_router_load.py [--clients 8] [--duration 15] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from common import markdown_table, write_result
from local_cluster import PatServeProcess, SGLangRouter
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model


async def client_loop(url: str, deadline: float, max_new: int, seq: int, out: dict) -> None:
    async with httpx.AsyncClient(timeout=300) as http:
        i = 0
        while time.monotonic() < deadline:
            rid = f"c{seq}-{i}-{uuid.uuid4().hex[:6]}"
            prompt = [10 + seq, 10 + i % 200, 7]
            t0 = time.monotonic()
            out["sent"] += 1
            try:
                r = await http.post(url + "/generate", json={"rid": rid, "input_ids": prompt, "sampling_params": {
                    "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}})
                body = r.json()
                ok = (r.status_code == 200 and body["meta_info"]["id"] == rid and len(body["output_ids"]) == max_new
                      and body["meta_info"]["finish_reason"]["type"] == "length")
            except Exception:
                ok = False
            if ok:
                out["good"] += 1
                out["tokens"] += max_new
                out["latency"].append(time.monotonic() - t0)
            i += 1


async def one_round(url: str, clients: int, duration: float, max_new: int) -> dict:
    out = {"sent": 0, "good": 0, "tokens": 0, "latency": []}
    start = time.monotonic()
    deadline = start + duration
    await asyncio.gather(*[client_loop(url, deadline, max_new, c, out) for c in range(clients)])
    out["seconds"] = time.monotonic() - start  # includes the last requests' tails
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of sending per round")
    ap.add_argument("--rounds", type=int, default=2, help="pairs of (1 worker, 2 workers) rounds")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--model", default=None, help="checkpoint (default: the built-in tiny model)")
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model or str(write_tiny_model(Path(tmp) / "tiny", TinyModelSpec()))
        with PatServeProcess(model, 1, 1, "float32") as a, PatServeProcess(model, 1, 1, "float32") as b, \
                SGLangRouter([a.url, b.url]) as router:
            rows, per = [], {1: [], 2: []}
            for r in range(ns.rounds):
                for workers in (1, 2):
                    if workers == 1:
                        router.remove_worker(b.url)
                    else:
                        router.add_worker(b.url)
                    time.sleep(1.0)  # the router's worker set has settled
                    assert len(router.workers()) == workers
                    res = asyncio.run(one_round(router.url, ns.clients, ns.duration, ns.max_new_tokens))
                    lat = sorted(res["latency"]) or [float("nan")]
                    row = [r, workers, res["sent"], res["good"], res["sent"] - res["good"],
                           res["good"] / res["seconds"], res["tokens"] / res["seconds"],
                           statistics.median(lat), lat[int(0.99 * (len(lat) - 1))]]
                    rows.append(row)
                    per[workers].append(row)
                    print(row, flush=True)
    mean = {w: statistics.mean(r[6] for r in per[w]) for w in per}
    lost = sum(r[4] for r in rows)
    table = markdown_table(["round", "workers", "sent", "good", "lost", "req/s", "tok/s", "p50 s", "p99 s"], rows)
    body = (f"{ns.clients} clients, {ns.duration:.0f} s per round, max_new_tokens={ns.max_new_tokens} (greedy, EOS "
            f"ignored), pat-serve `--world 1 --dtype float32` per instance, sglang-router round robin.\n\n{table}\n\n"
            f"Mean tokens/s: 1 worker {mean[1]:.1f}, 2 workers {mean[2]:.1f} (ratio {mean[2] / mean[1]:.2f}); "
            f"lost requests in all rounds: {lost}.\n\nEach instance runs one CPU worker process; on a machine "
            "with few cores the two instances share them, so the ratio shows the routing works, not how far "
            "it scales on separate nodes.")
    write_result("sglang_router_load", "sglang-router in front of pat-serve: 2 instances vs 1", body)


if __name__ == "__main__":
    main()
