"""Fault injection and bad input against pat-engine and pat-serve: each case with its outcome.

Three parts, all on the built-in tiny model (float32, CPU workers):

1. Bad input: 40+ kinds of malformed or hostile request, sent over HTTP to an
   in-process ``pat-serve`` app (API key on) plus a few through the Python
   API. Each must give a 4xx (or a clear exception) and the engine must still
   serve: a real request is answered after every case.
2. Driver memory: RSS of this process (the server's driver) before and after
   rejecting a 20 MB text prompt, three ways (body limit, character bound over
   HTTP with the body limit raised, Python API).
3. Faults: kill -9 of a worker mid-generation, SIGSTOP of a worker past the
   step timeout, a poison request among normal ones, restart-budget
   exhaustion, a worker crash inside a live switch, SIGTERM to ``pat-serve
   serve`` with streams in flight, and ``pat-serve serve`` whose engine
   cannot recover. Each reports recovery time, whether tokens equal a
   fault-free run, and whether any KV block is left allocated.

    python bench/faults.py            # writes bench/results/faults.md
"""

from __future__ import annotations

import argparse
import gc
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from common import markdown_table, rss_bytes, worker_processes, write_result
from fault_injection import FAULT_WORKER, inject_fault
from pat_engine import Engine, SamplingParams
from pat_engine.core.engine import RequestHandle
from pat_engine.serve.launcher import BackgroundServer
from pat_engine.serve.server import ServerConfig, build_app
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model

REPO = Path(__file__).resolve().parent.parent
KEY = "bench-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_LEN = 256
PROMPTS = [[5, 6, 7], [100, 20, 30, 40], [9], [250, 251], [33, 44, 55], [12, 13], [7, 8, 9, 10], [60]]


def rss_mb() -> float:
    return rss_bytes(os.getpid()) / 2**20


# ---- 1. bad input --------------------------------------------------------------------------------


@dataclass
class Bad:
    name: str
    path: str
    body: Any = None  # dict/list: JSON; bytes: raw
    headers: dict | None = None
    method: str = "POST"


def bad_inputs(vocab: int) -> list[Bad]:
    c = lambda **kw: {"prompt": [1, 2, 3], "max_tokens": 4, **kw}  # noqa: E731
    chat = lambda msgs, **kw: {"messages": msgs, "max_tokens": 4, **kw}  # noqa: E731
    u = [{"role": "user", "content": "hi"}]
    return [
        Bad("stop id past the vocab with min_tokens (issue repro)", "/v1/completions",
            c(min_tokens=2, stop_token_ids=[1_000_000])),
        Bad("stop id = vocab size", "/v1/completions", c(stop_token_ids=[vocab])),
        Bad("negative stop id", "/v1/completions", c(stop_token_ids=[-1])),
        Bad("2000 stop ids", "/v1/completions", c(stop_token_ids=list(range(2000)))),
        Bad("non-integer stop id", "/v1/completions", c(stop_token_ids=["a"])),
        Bad("temperature NaN", "/v1/completions", b'{"prompt": [1, 2], "temperature": NaN}'),
        Bad("temperature Infinity", "/v1/completions", b'{"prompt": [1, 2], "temperature": Infinity}'),
        Bad("temperature -1", "/v1/completions", c(temperature=-1)),
        Bad("temperature as text", "/v1/completions", c(temperature="hot")),
        Bad("top_p 0", "/v1/completions", c(top_p=0)),
        Bad("top_p 1.5", "/v1/completions", c(top_p=1.5)),
        Bad("top_p NaN", "/v1/completions", b'{"prompt": [1, 2], "top_p": NaN}'),
        Bad("top_k -2", "/v1/completions", c(top_k=-2)),
        Bad("top_k above the vocab", "/v1/completions", c(top_k=vocab + 1)),
        Bad("top_k 2.5", "/v1/completions", c(top_k=2.5)),
        Bad("seed 2**64", "/v1/completions", c(seed=2**64)),
        Bad("seed -2**63-1", "/v1/completions", c(seed=-(2**63) - 1)),
        Bad("seed as text", "/v1/completions", c(seed="x")),
        Bad("max_tokens 0", "/v1/completions", c(max_tokens=0)),
        Bad("max_tokens -5", "/v1/completions", c(max_tokens=-5)),
        Bad("max_tokens past the context", "/v1/completions", c(max_tokens=MAX_LEN)),
        Bad("min_tokens > max_tokens", "/v1/completions", c(min_tokens=9)),
        Bad("empty text prompt", "/v1/completions", {"prompt": "", "max_tokens": 4}),
        Bad("empty id list", "/v1/completions", {"prompt": [], "max_tokens": 4}),
        Bad("token id past the vocab", "/v1/completions", {"prompt": [1, vocab + 5], "max_tokens": 4}),
        Bad("negative token id", "/v1/completions", {"prompt": [1, -4], "max_tokens": 4}),
        Bad("float token ids", "/v1/completions", {"prompt": [1.5, 2.5], "max_tokens": 4}),
        Bad("id prompt longer than the context", "/v1/completions", {"prompt": [1] * (MAX_LEN + 10), "max_tokens": 4}),
        Bad("text over the character bound", "/v1/completions", {"prompt": "x" * (32 * MAX_LEN + 1), "max_tokens": 4}),
        Bad("300 prompts in one request", "/v1/completions", {"prompt": ["hi"] * 300, "max_tokens": 4}),
        Bad("mixed prompt list", "/v1/completions", {"prompt": ["hi", 3], "max_tokens": 4}),
        Bad("n above the cap (257)", "/v1/completions", c(n=257)),
        Bad("logprobs=6 (OpenAI's cap is 5)", "/v1/completions", c(logprobs=6)),
        Bad("echo with stream", "/v1/completions", c(echo=True, stream=True)),
        Bad("100 stop strings", "/v1/completions", c(stop=["x"] * 100)),
        Bad("a 5000-character stop string", "/v1/completions", c(stop=["x" * 5000])),
        Bad("logit_bias id past the vocab", "/v1/completions", c(logit_bias={str(vocab + 3): 5})),
        Bad("logit_bias key not an id", "/v1/completions", c(logit_bias={"abc": 5})),
        Bad("frequency_penalty 3", "/v1/completions", c(frequency_penalty=3)),
        Bad("repetition_penalty 0", "/v1/completions", c(repetition_penalty=0)),
        Bad("min_p 1.5", "/v1/completions", c(min_p=1.5)),
        Bad("best_of 3 with n 1", "/v1/completions", c(best_of=3)),
        Bad("unknown field functions", "/v1/completions", c(functions=[])),
        Bad("stream_options without stream", "/v1/completions", c(stream_options={"include_usage": True})),
        Bad("unknown model", "/v1/completions", c(model="gpt-9")),
        Bad("invalid JSON", "/v1/completions", b'{"prompt": [1, 2'),
        Bad("JSON array body", "/v1/completions", b"[1, 2, 3]"),
        Bad("nested JSON arrays, 5 KB", "/v1/completions", b"[" * 5000),
        Bad("nested JSON objects", "/generate", b'{"a":' * 3000 + b"1" + b"}" * 3000),
        Bad("nested arrays inside a field", "/generate", b'{"input_ids": ' + b"[" * 2000 + b"]" * 2000 + b"}"),
        Bad("wrong content type", "/v1/completions", b"prompt=hi", {"Content-Type": "text/plain"}),
        Bad("20 MB body (Content-Length)", "/v1/completions", "BIG"),
        Bad("20 MB body, chunked (no length)", "/v1/completions", "BIG-CHUNKED"),
        Bad("no API key", "/v1/completions", c(), {"Authorization": ""}),
        Bad("wrong API key", "/v1/completions", c(), {"Authorization": "Bearer nope"}),
        Bad("chat: no messages", "/v1/chat/completions", chat([])),
        Bad("chat: 3000 messages", "/v1/chat/completions", chat(u * 3000)),
        Bad("chat: unknown role", "/v1/chat/completions", chat([{"role": "wizard", "content": "hi"}])),
        Bad("chat: content over the character bound", "/v1/chat/completions",
            chat([{"role": "user", "content": "x" * (32 * MAX_LEN + 1)}])),
        Bad("chat: content is a number", "/v1/chat/completions", chat([{"role": "user", "content": 5}])),
        Bad("chat: top_logprobs 21", "/v1/chat/completions", chat(u, logprobs=True, top_logprobs=21)),
        Bad("chat: tool_choice auto", "/v1/chat/completions", chat(u, tool_choice="auto")),
        Bad("unknown route", "/v1/embeddings", c()),
        Bad("GET on a POST route", "/v1/completions", None, None, "GET"),
    ]


def _big_chunks(total: int, piece: int = 65536):
    """Exactly ``total`` bytes of ``{"prompt": "xxx..."}``, made piece by piece (no copy held)."""
    head, tail = b'{"prompt": "', b'"}'
    yield head
    left = total - len(head) - len(tail)
    while left > 0:
        n = min(piece, left)
        yield b"x" * n
        left -= n
    yield tail


def raw_post_declared(url: str, path: str, total: int) -> int:
    """POST with a declared 20 MB Content-Length, sending the body in small pieces: the client holds
    no copy, so the RSS measured is the server's. Returns the status code (the server answers early)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer {KEY}\r\n"
              f"Content-Length: {total}\r\nConnection: close\r\n\r\n".encode())
    if not select.select([s], [], [], 1.0)[0]:  # no early answer: the server waits for the body
        try:
            for piece in _big_chunks(total):
                s.sendall(piece)
        except OSError:
            pass  # the server answered and closed without reading the rest
    data = s.recv(65536)
    s.close()
    return int(data.split(b" ", 2)[1])


def send_bad(c: httpx.Client, url: str, b: Bad) -> httpx.Response | int:
    headers = {**AUTH, **(b.headers or {})}
    if b.body == "BIG":
        return raw_post_declared(url, b.path, 20 << 20)
    if b.body == "BIG-CHUNKED":
        return c.post(b.path, content=_big_chunks(20 << 20), headers={**headers, "Content-Type": "application/json"})
    if b.method == "GET":
        return c.get(b.path, headers=headers)
    if isinstance(b.body, bytes):
        return c.post(b.path, content=b.body, headers={"Content-Type": "application/json", **headers})
    return c.post(b.path, json=b.body, headers=headers)


def still_serving(c: httpx.Client) -> bool:
    r = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}, headers=AUTH)
    return r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def python_bad_inputs(engine: Engine) -> list[tuple[str, Callable[[], Any]]]:
    sp = SamplingParams
    return [
        ("python: stop id past the vocab (issue repro)", lambda: engine.generate(
            [[1, 5, 9]], sp(max_new_tokens=4, min_new_tokens=2, stop_token_ids=(10**6,)), use_tqdm=False)),
        ("python: temperature NaN", lambda: sp(temperature=float("nan"))),
        ("python: seed 2**70", lambda: sp(seed=2**70)),
        ("python: top_k above the vocab", lambda: engine.generate([[1]], sp(top_k=10**6), use_tqdm=False)),
        ("python: 20 MB text prompt", lambda: engine.generate(["x" * (20 << 20)], use_tqdm=False)),
        ("python: 10^6-token id prompt", lambda: engine.generate([[1] * 10**6], use_tqdm=False)),
        ("python: prompt of floats", lambda: engine.generate([[1.0, 2.0]], use_tqdm=False)),
    ]


def part_bad_input(engine: Engine) -> tuple[str, int, int]:
    app = build_app(engine, ServerConfig("tiny", api_key=KEY))
    rows, bad = [], 0
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        for b in bad_inputs(engine.arch.vocab_size):
            t = time.perf_counter()
            r = send_bad(c, srv.url, b)
            ms = (time.perf_counter() - t) * 1000
            status = r if isinstance(r, int) else r.status_code
            msg = "" if isinstance(r, int) else r.json()["error"]["message"]
            serving = still_serving(c)
            good = 400 <= status < 500 and serving
            bad += not good
            rows.append([b.name, "HTTP", status, msg[:90].replace("|", "/"), f"{ms:.0f}", "yes" if serving else "NO"])
        for name, fn in python_bad_inputs(engine):
            t = time.perf_counter()
            try:
                fn()
                outcome, good = "accepted (!)", False
            except ValueError as exc:  # InvalidRequestError is a ValueError
                outcome, good = f"{type(exc).__name__}: {str(exc)[:80]}", True
            ms = (time.perf_counter() - t) * 1000
            serving = still_serving(c)
            bad += not (good and serving)
            rows.append([name, "Python", "exception", outcome.replace("|", "/"), f"{ms:.0f}", "yes" if serving else "NO"])
        restarts = engine._loop.restarts
    table = markdown_table(["bad input", "via", "status", "message (start)", "ms", "engine still serving"], rows)
    return table, len(rows), bad + restarts


# ---- 2. driver memory after a 20 MB prompt --------------------------------------------------------


def _rss_rise(reject: Callable[[], str], times: int = 3) -> list:
    """RSS before, after the first rejection and after ``times`` of them (a rise that stays flat is the
    allocator keeping freed pages, not memory held per request)."""
    gc.collect()
    before = rss_mb()
    t = time.perf_counter()
    outcome = reject()
    took = time.perf_counter() - t
    gc.collect()
    first = rss_mb()
    for _ in range(times - 1):
        reject()
    gc.collect()
    last = rss_mb()
    return [outcome, f"{took:.2f}", f"{before:.1f}", f"{first - before:+.1f}", f"{last - before:+.1f}"]


def part_memory(engine: Engine) -> str:
    rows = []
    for limit, label in [(None, "HTTP, default body limit (16 MiB): 413 from the declared length"),
                         (64 << 20, "HTTP, body limit raised to 64 MiB: parsed, 400 from the character bound")]:
        cfg = ServerConfig("tiny", api_key=KEY) if limit is None else ServerConfig("tiny", api_key=KEY, max_body_bytes=limit)
        with BackgroundServer(build_app(engine, cfg)) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
            still_serving(c)
            rows.append([label] + _rss_rise(lambda: str(raw_post_declared(srv.url, "/v1/completions", 20 << 20))))

    def python_api() -> str:
        try:
            engine.generate(["x" * (20 << 20)], use_tqdm=False)  # the caller's own 20 MB string counts here too
            return "accepted (!)"
        except ValueError:
            return "InvalidRequestError"

    rows.append(["Python API, Engine.generate (the 20 MB string is made in this process)"] + _rss_rise(python_api))
    return markdown_table(["20 MB text prompt", "outcome", "seconds (first)", "RSS before MB",
                           "rise after 1 MB", "rise after 3 MB"], rows)


# ---- 3. faults -----------------------------------------------------------------------------------


def free_blocks_ok(engine: Engine) -> str:
    kv = engine.kv_blocks()
    free = all(g["free"] == g["total"] for g in kv["groups"])
    return f"{'all free' if free else 'LEAK ' + str(kv['groups'])}; invariants: {kv['invariants']}"


def run_batch(engine: Engine, n: int = 40) -> list[RequestHandle]:
    return [engine.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p in PROMPTS]


def wait_all(handles: list[RequestHandle], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    return all(h.wait(max(0.0, deadline - time.monotonic())) for h in handles)


def fault_kill(model: str, reference: list[list[int]]) -> list:
    with Engine(model, tp=1, dp=2, dtype="float32", max_model_len=MAX_LEN) as engine:
        hs = run_batch(engine)
        while not any(h.num_generated > 5 for h in hs):
            time.sleep(0.005)
        t = time.monotonic()
        os.kill(engine.coordinator.stepping.pool.procs[1].pid, signal.SIGKILL)
        done = wait_all(hs, 120)
        took = time.monotonic() - t
        same = [h.output().token_ids for h in hs] == reference
        return ["kill -9 of a worker mid-generation", "recovered" if done else "HUNG", f"{took:.1f}",
                "yes" if same else "NO", engine._loop.restarts, free_blocks_ok(engine)]


def fault_stop(model: str, reference: list[list[int]]) -> list:
    with Engine(model, tp=1, dp=2, dtype="float32", max_model_len=MAX_LEN, step_timeout_s=3) as engine:
        hs = run_batch(engine)
        while not any(h.num_generated > 5 for h in hs):
            time.sleep(0.005)
        t = time.monotonic()
        os.kill(engine.coordinator.stepping.pool.procs[0].pid, signal.SIGSTOP)
        while engine._loop.restarts == 0 and time.monotonic() - t < 60:
            time.sleep(0.02)
        detected = time.monotonic() - t
        done = wait_all(hs, 120)
        same = [h.output().token_ids for h in hs] == reference
        return ["SIGSTOP of a worker (step timeout 3 s)", f"detected after {detected:.1f} s, recovered" if done else "HUNG",
                f"{time.monotonic() - t:.1f}", "yes" if same else "NO", engine._loop.restarts, free_blocks_ok(engine)]


def fault_poison(model: str, reference: list[list[int]]) -> list:
    with Engine(model, tp=1, dp=2, dtype="float32", max_model_len=MAX_LEN) as engine:
        seqs = [engine.request_factory.make(p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for p in PROMPTS]
        poison = engine.request_factory.make([1, 5, 9], SamplingParams(max_new_tokens=4, min_new_tokens=2))
        object.__setattr__(poison.params, "stop_token_ids", (10**6,))  # past validation on purpose: any crashing step
        hs = [RequestHandle(s, engine.request_factory.decode) for s in seqs + [poison]]
        t = time.monotonic()
        engine._loop.thread.run(lambda: [engine._loop.admit([s]) for s in seqs[:4] + [poison] + seqs[4:]])
        done = wait_all(hs, 120)
        took = time.monotonic() - t
        out = hs[-1].output()
        same = [h.output().token_ids for h in hs[:-1]] == reference
        return ["poison request among 8 normal ones",
                f"poison: {out.finish_reason} ({(out.error or '')[:60]}...); others finished" if done else "HUNG",
                f"{took:.1f}", "yes" if same else "NO", engine._loop.restarts, free_blocks_ok(engine)]


def fault_budget(model: str) -> list:
    with Engine(model, tp=1, dp=1, dtype="float32", max_model_len=MAX_LEN, max_worker_restarts=1,
                restart_window_s=600, worker_class=FAULT_WORKER) as engine:
        crash = lambda: inject_fault(engine, None, "step", "exit")  # noqa: E731
        crash()
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4), use_tqdm=False)
        crash()
        t = time.monotonic()
        try:
            engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4), use_tqdm=False)
            first = "accepted (!)"
        except Exception as exc:
            first = type(exc).__name__
        took = time.monotonic() - t
        t2 = time.perf_counter()
        try:
            engine.submit([5, 6, 7], SamplingParams(max_new_tokens=4))
            refusal = "accepted (!)"
        except Exception as exc:
            refusal = f"{type(exc).__name__} in {(time.perf_counter() - t2) * 1000:.1f} ms"
        return ["restart budget used up (1 per 600 s, 2 crashes)",
                f"in-flight: {first}; next submit: {refusal}; health dead={bool(engine.health()['dead'])}",
                f"{took:.1f}", "n/a", engine._loop.restarts, "n/a (dead)"]


def fault_switch(model: str, reference: list[list[int]]) -> list:
    with Engine(model, tp=1, dp=2, dtype="float32", max_model_len=MAX_LEN, max_worker_restarts=10,
                worker_class=FAULT_WORKER) as engine:
        inject_fault(engine, [1], "reshard", "exit")
        t = time.monotonic()
        outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=40, ignore_eos=True), switch_schedule=[(10, 2)],
                               use_tqdm=False)
        took = time.monotonic() - t
        same = [o.token_ids for o in outs] == reference
        return ["worker exits inside a live switch (reshard)", "recovered", f"{took:.1f}", "yes" if same else "NO",
                engine._loop.restarts, free_blocks_ok(engine)]


def _serve(model: str, *extra: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO)] + sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "pat_engine.serve", "serve", "--model", model, "--port", "0",
                             "--dtype", "float32", "--max-model-len", str(MAX_LEN * 4), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "serving" not in line:
        raise SystemExit(f"pat-serve did not start: {line} {proc.stderr.read()}")
    return proc, line.strip().rsplit(" ", 1)[-1]


def fault_sigterm(model: str, drain_s: float = 2.0, clients: int = 8) -> list:
    proc, url = _serve(model, "--world", "2", "--drain-timeout", str(drain_s))
    ends: list[str] = []
    started = threading.Semaphore(0)

    def client(i: int) -> None:
        n = 20 if i % 2 else 900  # half finish within the drain timeout, half are cut off
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "prompt": [9, 8, 7 + i], "max_tokens": n, "ignore_eos": True, "stream": True}) as r:
                last = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        if not last:
                            started.release()
                        last = (last + [line[6:]])[-2:]
            ends.append("error+DONE" if last[-1] == "[DONE]" and '"error"' in last[0]
                        else "finished+DONE" if last[-1] == "[DONE]" else "NO DONE")
        except httpx.HTTPError as exc:
            ends.append(f"connection error {type(exc).__name__}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for th in threads:
        th.start()
    for _ in range(clients):
        started.acquire(timeout=60)
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(drain_s + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "HUNG"
    took = time.monotonic() - t
    for th in threads:
        th.join(10)
    err = proc.stderr.read()
    counts = {k: ends.count(k) for k in sorted(set(ends))}
    cancelled = err.count("CancelledError") + err.count("graceful shutdown exceeded")
    return [f"SIGTERM to pat-serve with {clients} streams (drain {drain_s:g} s)",
            f"exit {rc}; streams: {counts}; cancelled-task log lines: {cancelled}", f"{took:.1f}", "n/a", "n/a", "n/a"]


def fault_serve_dead(model: str) -> list:
    proc, url = _serve(model, "--max-worker-restarts", "0")
    t = time.monotonic()
    for worker in worker_processes(proc.pid):
        os.kill(worker, signal.SIGKILL)
    try:
        rc = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "HUNG"
    took = time.monotonic() - t
    last = [ln for ln in proc.stderr.read().splitlines() if "error" in ln][-1:]
    return ["pat-serve whose workers die with no restart allowed", f"exit {rc}: {(last or [''])[0][:90]}",
            f"{took:.1f}", "n/a", "n/a", "n/a"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-faults", action="store_true", help="bad input and memory only")
    ns = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_model(Path(tmp) / "tiny", TinyModelSpec()))
        with Engine(model, tp=1, dp=2, dtype="float32", max_model_len=MAX_LEN) as engine:
            bad_table, kinds, failures = part_bad_input(engine)
            memory = part_memory(engine)
            reference = [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_new_tokens=40, ignore_eos=True),
                                                              use_tqdm=False)]
        fault_rows = []
        if not ns.skip_faults:
            for fn in (lambda: fault_kill(model, reference), lambda: fault_stop(model, reference),
                       lambda: fault_poison(model, reference), lambda: fault_budget(model),
                       lambda: fault_switch(model, reference), lambda: fault_sigterm(model),
                       lambda: fault_serve_dead(model)):
                row = fn()
                print(" | ".join(map(str, row)), flush=True)
                fault_rows.append(row)
    faults = markdown_table(["fault", "outcome", "seconds to outcome", "tokens = fault-free run", "restarts",
                             "KV blocks at the end"], fault_rows)
    load_avg = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    body = (f"Machine load average (1/5/15 min) at the end: {load_avg}; other processes share the cores, so "
            "seconds are noisy.\n\n"
            "## Faults\n\nTiny model, float32, TP1xDP2 unless said. 'KV blocks at the end' reads every group's "
            f"allocator once nothing runs (and the coordinator's block invariant check when it has one).\n\n{faults}\n\n"
            f"## Driver memory after rejecting a 20 MB text prompt\n\n{memory}\n\n"
            f"## Bad input ({kinds} kinds; {failures} not rejected cleanly or engine restarts)\n\n"
            "Each case is sent to a running server (API key on, context 256 tokens) and followed by a real "
            f"request, which must be answered.\n\n{bad_table}")
    write_result("faults", "Faults and bad input", body)


if __name__ == "__main__":
    main()
