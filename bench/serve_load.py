"""Load test of ``pat-serve serve``: N concurrent clients on loopback for a bounded time.

Starts the real server process (``python -m pat_engine.serve serve --port 0``)
on the built-in tiny model, then each client sends requests back to back for
``--duration`` seconds: completions and chat, streamed and not, with
long-tail ``max_tokens`` (EOS ignored, so every answer's length is known).
Every prompt carries a unique nonce in its token ids and asks for them back
(``return_token_ids``), so a client can tell its answer from anyone else's.

With ``--disconnect-rate F`` a fraction F of the streamed requests hang up
after their first chunk (a client going away mid-stream): the server must
abort them and free their KV cache.

Checked at the end: every request got exactly one complete answer (none
lost, none duplicated, none mixed up), answer lengths are what was asked,
the server's own counters agree (finished = sent, the disconnected ones as
"abort", nothing left running), and every KV block is free again
(``GET /pat/kv``, with the coordinator's block invariant check when it has one).
Reported: throughput, p50/p99 latency, time to first token of streamed requests.

    python bench/serve_load.py [--clients 16] [--duration 20] [--world 2] [--switch-schedule 64:2]
    python bench/serve_load.py --clients 32 --duration 60 --switch-schedule 40:2,400:1,900:2,1500:1 \
        --disconnect-rate 0.1 --name serve_soak      # the issue-12 soak
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from common import markdown_table, settled_kv, write_result
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model

REPO = Path(__file__).resolve().parent.parent
NONCE_BASE, NONCE_OFFSET = 300, 10  # nonce digits as token ids 10..309 (inside the tiny vocabulary)


def nonce_tokens(nonce: int) -> list[int]:
    digits = []
    for _ in range(3):
        nonce, d = divmod(nonce, NONCE_BASE)
        digits.append(d + NONCE_OFFSET)
    return digits + [5, 6, 7]


@dataclass
class Result:
    nonce: int
    kind: str
    latency_s: float
    ttft_s: float | None
    tokens: int
    ok: bool
    problem: str = ""
    response_id: str = ""
    disconnected: bool = False  # hung up on purpose after the first chunk


@dataclass
class Load:
    results: list[Result] = field(default_factory=list)
    sent: int = 0


def _max_tokens(rng: random.Random) -> int:
    return rng.randint(64, 200) if rng.random() < 0.1 else rng.randint(4, 32)  # 10% long answers


async def one_request(client: httpx.AsyncClient, nonce: int, rng: random.Random, disconnect_rate: float = 0.0) -> Result:
    n = _max_tokens(rng)
    stream = rng.random() < 0.5
    chat = rng.random() < 0.25
    hang_up = stream and rng.random() < disconnect_rate
    prompt = nonce_tokens(nonce)
    common = {"model": "tiny", "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": stream,
              "return_token_ids": True}
    if chat:  # chat prompts are text: the nonce goes in the words, the ids are checked by length only
        url, body = "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"request {nonce}"}]}
    else:
        url, body = "/v1/completions", {**common, "prompt": prompt}
    kind = ("chat" if chat else "completion") + ("+stream" if stream else "")
    start = time.perf_counter()
    ttft, tokens, rid, echoed = None, [], "", None
    try:
        if stream:
            async with client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    return Result(nonce, kind, time.perf_counter() - start, None, 0, False, f"HTTP {r.status_code}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return Result(nonce, kind, time.perf_counter() - start, ttft, len(tokens), False,
                                      f"in-band error: {chunk['error']['message'][:80]}")
                    rid = chunk["id"]
                    if hang_up:  # leave mid-stream: closing the response drops the connection
                        return Result(nonce, kind + "+disconnect", time.perf_counter() - start, None, 0, True,
                                      response_id=rid, disconnected=True)
                    if chunk["choices"]:
                        ids = chunk["choices"][0].get("token_ids") or []
                        if ids and ttft is None:
                            ttft = time.perf_counter() - start
                        tokens += ids
                        echoed = chunk["choices"][0].get("prompt_token_ids", echoed)
                    echoed = chunk.get("prompt_token_ids", echoed)  # chat: on the first chunk
        else:
            r = await client.post(url, json=body)
            if r.status_code != 200:
                return Result(nonce, kind, time.perf_counter() - start, None, 0, False, f"HTTP {r.status_code}")
            data = r.json()
            rid, choice = data["id"], data["choices"][0]
            tokens, echoed = choice["token_ids"], choice.get("prompt_token_ids", data.get("prompt_token_ids"))
    except httpx.HTTPError as exc:
        return Result(nonce, kind, time.perf_counter() - start, None, 0, False, repr(exc))
    latency = time.perf_counter() - start
    problem = ""
    if len(tokens) != n:
        problem = f"{len(tokens)} tokens, asked {n}"
    elif not chat and echoed != prompt:
        problem = "answer belongs to another prompt"
    elif chat and not echoed:
        problem = "no prompt ids echoed"
    return Result(nonce, kind, latency, ttft, len(tokens), not problem, problem, rid)


async def client_loop(cid: int, url: str, deadline: float, load: Load, disconnect_rate: float) -> None:
    rng = random.Random(cid)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        seq = 0
        while time.perf_counter() < deadline:
            nonce = cid * 10_000 + seq
            seq += 1
            load.sent += 1
            load.results.append(await one_request(client, nonce, rng, disconnect_rate))


async def run_clients(n: int, url: str, deadline: float, load: Load, disconnect_rate: float = 0.0) -> None:
    await asyncio.gather(*(client_loop(c, url, deadline, load, disconnect_rate) for c in range(n)))


def metric_sum(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


def metric_sum_labelled(text: str, name: str, reason: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(
        rf'^{re.escape(name)}{{[^}}]*finished_reason="{re.escape(reason)}"[^}}]*}} (\S+)$', text, re.M))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def start_server(model: str, ns: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "pat_engine.serve", "serve", "--model", model, "--port", "0", "--served-model-name",
           "tiny", "--world", str(ns.world), "--tp", "1", "--dtype", "float32", "--max-queued-requests", "1024"]
    if ns.switch_schedule:
        cmd += ["--switch-schedule", ns.switch_schedule]
    if ns.kv_transfer:
        cmd += ["--kv-transfer", ns.kv_transfer]
    if ns.kv_cache_bytes:
        cmd += ["--kv-cache-bytes", str(ns.kv_cache_bytes)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    match = re.search(r"on (http://\S+)", line)
    if not match:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, match.group(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=20.0, help="seconds during which clients start new requests")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--switch-schedule", default="64:2", help="passed to the server; '' for a static layout")
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in tiny model in a temp dir)")
    p.add_argument("--disconnect-rate", type=float, default=0.0, help="fraction of streams that hang up early")
    p.add_argument("--name", default="serve_load", help="result file bench/results/NAME.md")
    p.add_argument("--kv-transfer", choices=("auto", "migrate", "recompute"), default=None, help="passed to the server")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="passed to the server (per rank)")
    ns = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model or str(write_tiny_model(Path(tmp) / "tiny", TinyModelSpec()))
        proc, url = start_server(model, ns)
        try:
            load = Load()
            start = time.perf_counter()
            deadline = start + ns.duration
            asyncio.run(run_clients(ns.clients, url, deadline, load, ns.disconnect_rate))
            wall = time.perf_counter() - start
            kv = settled_kv(url)
            metrics = httpx.get(url + "/metrics").text
        finally:
            proc.terminate()
            proc.wait(60)
    report(ns, load, wall, metrics, kv)


def report(ns: argparse.Namespace, load: Load, wall: float, metrics: str, kv: dict) -> None:
    res = load.results
    hung_up = sum(1 for r in res if r.disconnected)
    aborted_server = metric_sum_labelled(metrics, "pat:request_success_total", "abort")
    blocks_free = all(g["free"] == g["total"] for g in kv["groups"])
    kv_line = (f"KV blocks at the end ({kv['layout']}): " + ", ".join(f"group {g['group']}: {g['free']}/{g['total']} free"
                                                                    for g in kv["groups"])
               + f"; unfinished requests: {kv['unfinished']}; block invariant check: {kv['invariants']}")
    res = [r for r in res if not r.disconnected]
    ok = [r for r in res if r.ok]
    nonces = [r.nonce for r in res]
    ids = [r.response_id for r in res if r.response_id]
    finished_server = metric_sum(metrics, "pat:request_success_total")
    lost = load.sent - hung_up - len(res) + sum(1 for r in res if not r.ok)
    duplicated = (len(nonces) - len(set(nonces))) + (len(ids) - len(set(ids)))
    lat = [r.latency_s for r in ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tokens = sum(r.tokens for r in ok)
    rows = [[ns.clients, f"{ns.duration:g}", f"{wall:.1f}", load.sent, len(ok), hung_up, int(aborted_server), lost,
             duplicated, int(finished_server),
             int(metric_sum(metrics, "pat:num_requests_running")), f"{len(ok) / wall:.2f}", f"{tokens / wall:.0f}",
             f"{pct(lat, 50):.3f}", f"{pct(lat, 99):.3f}", f"{pct(ttft, 50):.3f}",
             int(metric_sum(metrics, "pat:layout_switches_total"))]]
    headers = ["clients", "duration s", "wall s", "sent", "ok", "hung up", "server aborted", "lost/failed",
               "duplicated", "server finished",
               "server running", "req/s", "tokens/s", "p50 latency s", "p99 latency s", "p50 TTFT s (stream)",
               "switches"]
    kinds = sorted({r.kind for r in res})
    by_kind = [[k, sum(1 for r in ok if r.kind == k), f"{pct([r.latency_s for r in ok if r.kind == k], 50):.3f}",
                f"{pct([r.latency_s for r in ok if r.kind == k], 99):.3f}"] for k in kinds]
    problems = sorted({r.problem for r in res if r.problem})
    # a hung-up stream whose request finished before the server saw the disconnect is not aborted
    clean = (lost == 0 and duplicated == 0 and finished_server == load.sent and aborted_server <= hung_up
             and blocks_free and kv["unfinished"] == 0)
    verdict = ("no request lost, failed or duplicated; the server's finished count equals the requests sent, "
               "every hung-up stream was aborted, and every KV block is free" if clean else
               f"PROBLEMS: lost/failed {lost}, duplicated {duplicated}, server finished {finished_server:.0f} "
               f"of {load.sent} sent, aborted {aborted_server:.0f} of {hung_up} hung up, KV blocks all free: "
               f"{blocks_free}; {problems[:5]}")
    load_avg = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    body = (f"Machine load average (1/5/15 min) at the end: {load_avg}; other processes may share the cores.\n\n"
            f"Server: `pat-serve serve` on the built-in tiny model, world {ns.world} starting at TP1xDP{ns.world}, "
            f"float32, switch schedule `{ns.switch_schedule or 'none'}`, kv transfer `{ns.kv_transfer or 'auto'}`, "
            f"KV bytes per rank `{ns.kv_cache_bytes or 'default'}`; clients send back to back for "
            f"{ns.duration:g} s (then finish what is in flight). 50% streamed, 25% chat; max_tokens 4-32 "
            f"(10%: 64-200), EOS ignored; {ns.disconnect_rate:.0%} of streams hang up after their first chunk.\n\n"
            + markdown_table(headers, rows) + "\n\n" + markdown_table(["kind", "ok", "p50 s", "p99 s"], by_kind)
            + f"\n\n{kv_line}\n\nResult: {verdict}.")
    write_result(ns.name, "pat-serve load test", body)


if __name__ == "__main__":
    main()
