"""Chaos under load: everything an RL framework does to pat-serve, at once, with every answer checked.

A real ``pat-serve serve`` process (world 2, float64, so any changed token is corruption and not
rounding; prefix caching on; the default CPU KV pool) is driven for ``--duration`` seconds by:

- ``--clients`` concurrent clients on SGLang's ``/generate`` and OpenAI's ``/v1/completions``:
  greedy, EOS ignored, a fixed set of prompts that repeat (so the prefix cache serves them), some
  with n=2, some streamed, some hanging up after their first chunk, some held to a JSON schema
  (structured output: their grammar follows them through every switch, pause and restart);
- a live layout switch every ``--switch-every`` seconds (``/pat/reconfigure``, TP1 <-> TP2);
- every ``--boundary-every`` seconds the step boundary slime and veRL use: ``/pause_generation``
  (mode abort) -> ``/release_memory_occupation`` -> ``/resume_memory_occupation`` ->
  ``/continue_generation``;
- every ``--resume-every`` seconds a ``/resume_memory_occupation`` out of turn (a client retrying);
- a hostile or malformed body every ``--bad-every`` seconds (bench/faults.py's list, deeply nested
  JSON among them), each of which must get a 4xx;
- one worker process killed with SIGKILL half-way.

The reference for each prompt is its tokens taken alone before the chaos starts. Each request
ends as one of: **completed** (finished, tokens equal to the reference), **explicit error** (an
HTTP error with a message, or finished as aborted with its partial tokens a prefix of the
reference), **lost** (no answer within the client timeout, or the connection broke without the
client hanging up), **corrupted** (any token differing from the reference), or hung up on
purpose. Goal: lost = corrupted = 0 and no 5xx for bad input.

    python bench/chaos.py --duration 600        # writes bench/results/chaos.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from common import markdown_table, settled_kv, worker_processes, write_result
from faults import AUTH, KEY, MAX_LEN, bad_inputs, send_bad
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model

REPO = Path(__file__).resolve().parent.parent
KINDS = ("generate", "generate-n2", "generate-stream", "completions", "completions-stream", "hang-up",
         "completions-json")
# what the "completions-json" kind is held to (compact, so the tiny model's answers end inside their budget)
STRUCTURED = {"json": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                       "required": ["a", "b"]}, "disable_any_whitespace": True}


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    max_new: int


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # completed / explicit error / lost / corrupted / hung up
    errors: Counter = field(default_factory=Counter)  # explicit errors by kind
    by_kind: Counter = field(default_factory=Counter)
    corrupt_examples: list[str] = field(default_factory=list)
    lost_examples: list[str] = field(default_factory=list)
    bad: Counter = field(default_factory=Counter)  # bad-input answers by status class
    bad_5xx: list[str] = field(default_factory=list)
    control: Counter = field(default_factory=Counter)  # switches, boundaries, resumes: ok / refused / failed
    kill: str = "not done"


def make_prompts(n: int, rng: random.Random) -> list[Prompt]:
    return [Prompt([rng.randrange(3, 380) for _ in range(rng.randint(20, 70))], rng.choice([8, 16, 24, 40, 64]))
            for _ in range(n)]


def classify(tally: Tally, kind: str, want: list[int], got: list[int], finish: str | None) -> None:
    """One answer's tokens against the reference."""
    tally.by_kind[kind] += 1
    if got != want[: len(got)]:
        tally.outcomes["corrupted"] += 1
        first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b) if got[: len(want)] != want[: len(got)] \
            else len(want)
        tally.corrupt_examples.append(f"{kind}: differs at token {first} of {len(got)}")
    elif finish in ("length", "stop") and len(got) == len(want):
        tally.outcomes["completed"] += 1
    else:
        tally.outcomes["explicit error"] += 1
        tally.errors[f"finished as {finish} with a prefix of the reference"] += 1


def in_band_error(tally: Tally, kind: str, error: dict) -> None:
    """A stream that ended with an error object: an explicit error, not a lost request."""
    tally.by_kind[kind] += 1
    tally.outcomes["explicit error"] += 1
    tally.errors[f"in-band error: {error.get('message', '')[:60]}"] += 1


def http_error(tally: Tally, kind: str, status: int, text: str) -> None:
    tally.by_kind[kind] += 1
    try:
        message = json.loads(text)
        message = message.get("error", {}).get("message") or message.get("message") or text
    except (ValueError, AttributeError):
        message = text
    tally.outcomes["explicit error"] += 1
    tally.errors[f"HTTP {status}: {str(message)[:60]}"] += 1


async def sse_objects(response: httpx.Response):
    async for line in response.aiter_lines():
        if line.startswith("data: {"):
            yield json.loads(line[6:])


async def one_request(client: httpx.AsyncClient, prompt: Prompt, want: list[int], kind: str, tally: Tally) -> None:
    sp = {"max_new_tokens": prompt.max_new, "temperature": 0, "ignore_eos": True}
    try:
        if kind == "completions-json":  # EOS ends it where the schema is complete: not ignored
            r = await client.post("/v1/completions", json={"prompt": prompt.ids, "max_tokens": prompt.max_new,
                                                           "temperature": 0, "return_token_ids": True,
                                                           "structured_outputs": STRUCTURED})
            if r.status_code != 200:
                return http_error(tally, kind, r.status_code, r.text)
            choice = r.json()["choices"][0]
            return classify(tally, kind, want, choice["token_ids"], choice["finish_reason"])
        if kind in ("generate", "generate-n2"):
            n = 2 if kind == "generate-n2" else 1
            r = await client.post("/generate", json={"input_ids": prompt.ids, "sampling_params": {**sp, "n": n}})
            if r.status_code != 200:
                return http_error(tally, kind, r.status_code, r.text)
            for obj in (r.json() if n > 1 else [r.json()]):
                classify(tally, kind, want, obj["output_ids"], (obj["meta_info"]["finish_reason"] or {}).get("type"))
        elif kind == "generate-stream":
            async with client.stream("POST", "/generate", json={"input_ids": prompt.ids, "sampling_params": sp,
                                                                "stream": True}) as r:
                if r.status_code != 200:
                    return http_error(tally, kind, r.status_code, (await r.aread()).decode())
                last = None
                async for obj in sse_objects(r):
                    if "error" in obj:
                        return in_band_error(tally, kind, obj["error"])
                    last = obj
            if last is None:
                tally.outcomes["lost"] += 1
                tally.lost_examples.append(f"{kind}: stream ended without a response")
                return
            classify(tally, kind, want, last["output_ids"], (last["meta_info"]["finish_reason"] or {}).get("type"))
        else:
            body = {"prompt": prompt.ids, "max_tokens": prompt.max_new, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, "stream": kind != "completions"}
            if kind == "completions":
                r = await client.post("/v1/completions", json=body)
                if r.status_code != 200:
                    return http_error(tally, kind, r.status_code, r.text)
                choice = r.json()["choices"][0]
                return classify(tally, kind, want, choice["token_ids"], choice["finish_reason"])
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return http_error(tally, kind, r.status_code, (await r.aread()).decode())
                got, finish = [], None
                async for obj in sse_objects(r):
                    if "error" in obj:
                        return in_band_error(tally, kind, obj["error"])
                    if kind == "hang-up":  # leave after the first chunk
                        tally.outcomes["hung up"] += 1
                        tally.by_kind[kind] += 1
                        return
                    if obj["choices"]:
                        got += obj["choices"][0].get("token_ids") or []
                        finish = obj["choices"][0].get("finish_reason") or finish
            classify(tally, kind, want, got, finish)
    except (httpx.TimeoutException, httpx.TransportError) as exc:
        tally.by_kind[kind] += 1
        tally.outcomes["lost"] += 1
        tally.lost_examples.append(f"{kind}: {exc!r}"[:120])


async def client_loop(cid: int, url: str, prompts: list[Prompt], refs: dict[str, list[list[int]]], deadline: float,
                      tally: Tally, timeout: float) -> None:
    rng = random.Random(1000 + cid)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=timeout) as client:
        while time.monotonic() < deadline:
            i, kind = rng.randrange(len(prompts)), rng.choice(KINDS)
            want = refs["structured" if kind == "completions-json" else "plain"][i]
            await one_request(client, prompts[i], want, kind, tally)


async def every(seconds: float, deadline: float, action) -> None:
    while True:
        await asyncio.sleep(seconds)
        if time.monotonic() >= deadline:
            return
        await action()


async def controllers(url: str, ns: argparse.Namespace, deadline: float, tally: Tally, server_pid: int) -> None:
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=ns.timeout) as c:
        tp = {"next": 2}

        async def control(name: str, path: str, body: dict) -> dict:
            try:
                r = await c.post(path, json=body)
            except httpx.HTTPError as exc:
                tally.control[f"{name}: failed ({type(exc).__name__})"] += 1
                return {}
            ok = r.status_code == 200 and r.json().get("success", r.json().get("status") == "ok") is not False
            tally.control[f"{name}: {'ok' if ok else f'refused ({r.status_code})'}"] += 1
            if r.status_code >= 500:
                tally.control[f"{name}: 5xx: {r.text[:80]}"] += 1
            return r.json() if r.headers.get("content-type", "").startswith("application/json") else {}

        async def switch() -> None:
            await control("switch", "/pat/reconfigure", {"tp": tp["next"]})
            tp["next"] = 3 - tp["next"]

        async def boundary() -> None:
            await control("pause (abort)", "/pause_generation", {"mode": "abort"})
            await control("release memory", "/release_memory_occupation", {})
            await control("resume memory", "/resume_memory_occupation", {})
            await control("continue", "/continue_generation", {})

        async def stray_resume() -> None:
            await control("resume out of turn", "/resume_memory_occupation", {})

        async def kill_one() -> None:
            await asyncio.sleep(max(0.0, deadline - time.monotonic()) / 2)
            workers = worker_processes(server_pid)
            if workers:
                os.kill(workers[-1], signal.SIGKILL)
                tally.kill = f"SIGKILL to worker pid {workers[-1]} at {time.strftime('%H:%M:%S')}"

        await asyncio.gather(every(ns.switch_every, deadline, switch), every(ns.boundary_every, deadline, boundary),
                             every(ns.resume_every, deadline, stray_resume), kill_one())


def bad_input_loop(url: str, every_s: float, deadline: float, tally: Tally, stop: threading.Event) -> None:
    cases = bad_inputs(TinyModelSpec().vocab_size)
    i = 0
    with httpx.Client(base_url=url, timeout=120) as c:
        while time.monotonic() < deadline and not stop.is_set():
            case = cases[i % len(cases)]
            i += 1
            try:
                r = send_bad(c, url, case)
                status = r if isinstance(r, int) else r.status_code
            except httpx.HTTPError as exc:
                tally.bad["no answer"] += 1
                tally.bad_5xx.append(f"{case.name}: {exc!r}"[:100])
                continue
            tally.bad[f"{status // 100}xx"] += 1
            if status >= 500 or status < 400:
                tally.bad_5xx.append(f"{case.name}: {status}")
            stop.wait(every_s)


def start_server(model: str, ns: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "pat_engine.serve", "serve", "--model", model, "--port", "0", "--served-model-name",
           "tiny", "--world", str(ns.world), "--tp", "1", "--dtype", "float64", "--max-model-len", str(MAX_LEN),
           "--api-key", KEY, "--max-queued-requests", "1024", "--max-worker-restarts", "8"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "on http://" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return proc, line.split("on ", 1)[1].split()[0]


def references(url: str, prompts: list[Prompt]) -> dict[str, list[list[int]]]:
    """Each prompt's tokens taken alone, before any chaos: plain, and held to ``STRUCTURED``."""
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c:
        plain = [c.post("/generate", json={"input_ids": p.ids, "sampling_params": {
            "max_new_tokens": p.max_new, "temperature": 0, "ignore_eos": True}}).json()["output_ids"] for p in prompts]
        structured = [c.post("/v1/completions", json={
            "prompt": p.ids, "max_tokens": p.max_new, "temperature": 0, "return_token_ids": True,
            "structured_outputs": STRUCTURED}).json()["choices"][0]["token_ids"] for p in prompts]
    return {"plain": plain, "structured": structured}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--switch-every", type=float, default=3.0)
    p.add_argument("--boundary-every", type=float, default=12.0)
    p.add_argument("--resume-every", type=float, default=9.0)
    p.add_argument("--bad-every", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=120.0, help="a request unanswered this long is lost")
    p.add_argument("--name", default="chaos")
    ns = p.parse_args()
    tally = Tally()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_model(Path(tmp) / "tiny", TinyModelSpec()))
        proc, url = start_server(model, ns)
        try:
            prompts = make_prompts(ns.prompts, random.Random(7))
            refs = references(url, prompts)
            start = time.monotonic()
            deadline = start + ns.duration
            stop = threading.Event()
            bad = threading.Thread(target=bad_input_loop, args=(url, ns.bad_every, deadline, tally, stop), daemon=True)
            bad.start()

            async def everything() -> None:
                await asyncio.gather(controllers(url, ns, deadline, tally, proc.pid),
                                     *(client_loop(i, url, prompts, refs, deadline, tally, ns.timeout)
                                       for i in range(ns.clients)))

            asyncio.run(everything())
            stop.set()
            bad.join(150)
            wall = time.monotonic() - start
            kv = settled_kv(url, AUTH, timeout=60)
            health = httpx.get(url + "/health", headers=AUTH, timeout=60).status_code
        finally:
            proc.terminate()
            proc.wait(60)
    report(ns, tally, wall, kv, health)


def report(ns: argparse.Namespace, tally: Tally, wall: float, kv: dict, health: int) -> None:
    o = tally.outcomes
    sent = sum(tally.by_kind.values())
    rows = [[f"{wall:.0f}", sent, o["completed"], o["explicit error"], o["hung up"], o["lost"], o["corrupted"],
             tally.bad["4xx"], tally.bad["5xx"] + tally.bad["2xx"] + tally.bad["no answer"]]]
    blocks_free = all(g["free"] == g["total"] for g in kv["groups"])
    ok = o["lost"] == 0 and o["corrupted"] == 0 and not tally.bad_5xx and blocks_free and health == 200
    body = (f"Server: `pat-serve serve`, tiny Llama, world {ns.world} from TP1xDP{ns.world}, float64, "
            f"max-model-len {MAX_LEN}, API key on. {ns.clients} clients over {ns.prompts} repeating prompts "
            f"(kinds: {', '.join(KINDS)}); a switch every {ns.switch_every:g} s, the RL step boundary every "
            f"{ns.boundary_every:g} s, a stray resume every {ns.resume_every:g} s, a bad body every "
            f"{ns.bad_every:g} s, one worker killed half-way.\n\n"
            + markdown_table(["wall s", "requests", "completed (reference tokens)", "explicit error", "hung up",
                              "lost", "corrupted", "bad input: 4xx", "bad input: not 4xx"], rows)
            + "\n\nExplicit errors:\n\n" + markdown_table(["kind", "count"], [[k, v] for k, v in tally.errors.most_common()])
            + "\n\nRequests by kind:\n\n" + markdown_table(["kind", "count"], sorted(tally.by_kind.items()))
            + "\n\nControl calls:\n\n" + markdown_table(["call: answer", "count"], sorted(tally.control.items()))
            + f"\n\nWorker kill: {tally.kill}.\n\n"
            + f"At the end: health {health}; KV ({kv['layout']}): "
            + ", ".join(f"group {g['group']} {g['free']}/{g['total']} free" for g in kv["groups"])
            + f"; unfinished {kv['unfinished']}; block invariants {kv['invariants']}.\n\n"
            + (f"Corrupted (first 5): {tally.corrupt_examples[:5]}\n\n" if tally.corrupt_examples else "")
            + (f"Lost (first 5): {tally.lost_examples[:5]}\n\n" if tally.lost_examples else "")
            + (f"Bad input not answered 4xx: {tally.bad_5xx[:10]}\n\n" if tally.bad_5xx else "")
            + f"Result: {'goal met: nothing lost, nothing corrupted, every bad body a 4xx' if ok else 'GOAL MISSED'}.")
    write_result(ns.name, "Chaos under load: memory release/resume, switches, pauses, bad input, a killed worker",
                 body)


if __name__ == "__main__":
    main()
