"""Issue 12, end to end: no request can take the engine down, no silent hang, clear errors.

Each test starts real worker processes (slow). Tokens after a recovery are
compared with transformers (float64), as everywhere else.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from safetensors.torch import load_file, save_file

from common import worker_processes
from conftest import hf_greedy
from fault_injection import FAULT_WORKER, inject_fault
from pat_engine import Engine, EngineDeadError, ModelLoadError, SamplingParams, WorkerFailure
from pat_engine.core.engine import RequestHandle
from pat_engine.serve.launcher import BackgroundServer
from pat_engine.serve.server import ServerConfig, build_app
from serve_cli_util import cli_cmd, cli_env

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7], [100, 20, 30], [9], [250, 251]]


def poison_request(engine: Engine, prompt: list[int]):
    """A request that crashes the worker's sampler (defect 1), smuggled past today's validation on purpose:
    it stands for any request that makes its step fail."""
    seq = engine.request_factory.make(prompt, SamplingParams(max_new_tokens=4, min_new_tokens=2))
    object.__setattr__(seq.params, "stop_token_ids", (10**6,))
    return seq, RequestHandle(seq, engine.request_factory.decode)


def normal_request(engine: Engine, prompt: list[int], n: int):
    seq = engine.request_factory.make(prompt, SamplingParams(max_new_tokens=n))
    return seq, RequestHandle(seq, engine.request_factory.decode)


def admit_each(engine: Engine, seqs: list) -> None:
    """Queue requests past the API (as the engine would queue them), each routed on its own."""
    engine._loop.thread.run(lambda: [engine._loop.admit([s]) for s in seqs])


def test_poison_request_is_failed_alone_and_the_rest_continue(model_dir):
    path = model_dir("llama")
    with Engine(path, tp=1, dp=2, dtype="float64", max_model_len=128) as engine:
        made = [normal_request(engine, p, 12) for p in PROMPTS]
        bad_seq, bad = poison_request(engine, [1, 5, 9])
        seqs = [s for s, _ in made]
        admit_each(engine, seqs[:2] + [bad_seq] + seqs[2:])
        good = [h for _, h in made]
        for h in good + [bad]:
            assert h.wait(120), "a request hung"
        out = bad.output()
        assert out.finish_reason == "error" and "failed alone" in out.error, out.error
        for h, p in zip(good, PROMPTS):
            assert h.output().finish_reason == "length" and h.output().token_ids == hf_greedy(path, p, 12)
        assert engine.dead is None and engine._loop.restarts == 2
        again = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6), use_tqdm=False)[0]
        assert again.token_ids == hf_greedy(path, [5, 6, 7], 6)


def test_out_of_vocab_stop_id_is_refused_before_any_worker(model_dir):
    """The issue's repro: refused at once with a message naming the field; the engine never restarts."""
    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float64", max_model_len=64) as engine:
        with pytest.raises(ValueError, match="stop_token_ids: token id 1000000 is outside the vocabulary"):
            engine.generate([[1, 5, 9]], SamplingParams(max_new_tokens=4, min_new_tokens=2, stop_token_ids=(10**6,)),
                            use_tqdm=False)
        assert engine._loop.restarts == 0 and engine.dead is None


def test_used_up_restart_budget_refuses_new_requests_at_once(model_dir):
    """Defect 3: after the budget is used up, submit() accepted requests that never finished."""
    path = model_dir("llama")
    with Engine(path, tp=1, dp=1, dtype="float64", max_worker_restarts=1, restart_window_s=600,
                worker_class=FAULT_WORKER) as engine:
        crash = lambda: inject_fault(engine, None, "step", "exit")
        crash()
        out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6), use_tqdm=False)[0]  # recovered
        assert out.token_ids == hf_greedy(path, [5, 6, 7], 6)
        crash()
        with pytest.raises(WorkerFailure, match="restart budget"):
            engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6), use_tqdm=False)
        assert engine.dead and "1 restarts per 600s" in engine.dead
        t = time.perf_counter()
        with pytest.raises(EngineDeadError, match="cannot serve"):
            engine.submit([5, 6, 7], SamplingParams(max_new_tokens=4))
        with pytest.raises(EngineDeadError, match="cannot serve"):
            engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4), use_tqdm=False)
        assert time.perf_counter() - t < 1.0
        assert engine.health()["dead"] == engine.dead


def test_stopped_worker_is_detected_within_the_step_timeout(model_dir):
    """Defect 4: SIGSTOP a worker mid-generation; the step timeout replaces it and tokens are unchanged."""
    path = model_dir("llama")
    with Engine(path, tp=1, dp=2, dtype="float64", max_model_len=256, step_timeout_s=2) as engine:
        handles = [engine.submit(p, SamplingParams(max_new_tokens=150, ignore_eos=True)) for p in PROMPTS]
        while not any(h.num_generated > 5 for h in handles):
            time.sleep(0.01)
        victim = engine.coordinator.stepping.pool.procs[0].pid
        os.kill(victim, signal.SIGSTOP)
        t = time.monotonic()
        while engine._loop.restarts == 0:
            assert time.monotonic() - t < 2 + 5, "a stopped worker went unnoticed"
            time.sleep(0.05)
        detected = time.monotonic() - t
        for h in handles:
            assert h.wait(120)
        for h, p in zip(handles, PROMPTS):
            assert h.output().token_ids == hf_greedy(path, p, 150)
        assert "did not finish a step within step_timeout_s=2" in engine._loop.failures[-1]
        assert 1.5 < detected < 7, detected
    with pytest.raises(ProcessLookupError):  # the stopped worker was killed, not orphaned
        os.kill(victim, 0)


def test_nan_weights_are_a_load_error(model_dir, tmp_path):
    bad = tmp_path / "nan"
    shutil.copytree(model_dir("llama"), bad)
    f = bad / "model.safetensors"
    tensors = load_file(str(f))
    name = next(k for k in tensors if k.endswith("mlp.down_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(f))
    with pytest.raises(ModelLoadError, match=f"{name.removeprefix('model.')}.* NaN"):
        Engine(str(bad), tp=1, dp=1)


# ---- over HTTP -----------------------------------------------------------------------------------


def test_http_health_limits_and_dead_engine(model_dir):
    path = model_dir("llama")
    with Engine(path, tp=1, dp=1, dtype="float64", max_model_len=128, max_worker_restarts=0) as engine:
        app = build_app(engine, ServerConfig("tiny", max_body_bytes=1 << 20, api_key="k"))
        with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30,
                                                        headers={"Authorization": "Bearer k"}) as c:
            h = c.get("/health").json()
            assert h["status"] == "ok" and h["workers_alive"] and h["restarts"] == 0
            r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "min_tokens": 2,
                                                "stop_token_ids": [1000000]})  # the curl
            assert r.status_code == 400 and "stop_token_ids" in r.json()["error"]["message"]
            r = c.post("/v1/completions", json={"prompt": "x" * 5000, "max_tokens": 4})
            assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
            t = time.perf_counter()
            r = c.post("/v1/completions", content=b'{"prompt": "' + b"x" * (20 << 20) + b'"}',
                       headers={"Content-Type": "application/json"})
            assert r.status_code == 413, r.text
            assert httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
            assert httpx.get(srv.url + "/metrics").status_code == 200  # no key needed
            ok = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
            assert ok.json()["choices"][0]["finish_reason"] == "length"
            # the workers die and the budget (0) allows no restart: the engine is dead, health says why
            os.kill(engine.coordinator.stepping.pool.procs[0].pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while engine.dead is None:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            r = c.get("/health")
            assert r.status_code == 503 and "cannot serve" in r.json()["error"]["message"]
            t = time.perf_counter()
            r = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4})
            assert r.status_code == 503 and "cannot serve" in r.json()["error"]["message"]
            assert time.perf_counter() - t < 2


def test_drain_ends_open_streams_with_an_error_event_and_done(model_dir):
    """Defect 7, in-process: the drain timeout cuts a stream off in-band, then [DONE]."""
    with Engine(model_dir("llama"), tp=1, dp=1, dtype="float64", max_model_len=512) as engine:
        app = build_app(engine, ServerConfig("tiny", drain_timeout_s=0.5))
        pat = app.state.pat
        with BackgroundServer(app, graceful_s=3.5, on_exit=pat.begin_drain) as srv, \
                httpx.Client(base_url=srv.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": [9, 8, 7], "max_tokens": 500, "ignore_eos": True,
                                                           "stream": True}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                engine.pause()  # hold it in flight, however fast this machine is
                srv.server.handle_exit(signal.SIGTERM, None)
                events = [ln[6:] for ln in lines if ln.startswith("data: ")]
            engine.resume()
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == 503 and "drain timeout" in err["message"]
        assert engine.num_unfinished_requests() == 0


def _start_server(path: str, *extra: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(cli_cmd("serve", "--model", path, "--port", "0", "--dtype", "float64",
                                    "--max-model-len", "1024", *extra),
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "serving" in line, line + proc.stderr.read()
    return proc, line.strip().rsplit(" ", 1)[-1]


def test_sigterm_with_a_stream_in_flight_exits_cleanly(model_dir):
    """Defect 7, the real command: error event + [DONE] for the open stream, exit 0 within drain + a few s.

    No drain time: the stream must still be open when the drain ends, and the tiny model's 1000 tokens take
    about a second on a fast host (a drain of 1 s let the request finish there, now and then)."""
    proc, url = _start_server(model_dir("llama"), "--drain-timeout", "0")
    try:
        events: list[str] = []

        def client() -> None:
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"prompt": [9, 8, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
                events.extend(ln[6:] for ln in r.iter_lines() if ln.startswith("data: "))

        th = threading.Thread(target=client)
        th.start()
        while not events:
            time.sleep(0.01)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
        took = time.monotonic() - t
        th.join(10)
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert rc == 0, err
    assert took < 5, took
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
    assert "CancelledError" not in err and "graceful shutdown exceeded" not in err, err


def test_server_exits_nonzero_when_the_engine_cannot_recover(model_dir):
    proc, url = _start_server(model_dir("llama"), "--max-worker-restarts", "0")
    try:
        assert httpx.get(url + "/health").status_code == 200
        for pid in worker_processes(proc.pid):
            os.kill(pid, signal.SIGKILL)
        rc = proc.wait(30)
    finally:
        proc.kill()
    assert rc == 1
    assert "cannot serve" in proc.stderr.read()


def test_pat_serve_step_timeout_flag_catches_a_stopped_worker(model_dir):
    """Defect 4 under pat-serve: --step-timeout reaches the engine, /health says why the workers were
    replaced (503 while they are, if it is asked then: forked workers are back in a fraction of a second),
    the request is recomputed on fresh workers and answered in full."""
    proc, url = _start_server(model_dir("llama"), "--step-timeout", "2")
    try:
        result: dict = {}

        def client() -> None:
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "prompt": [9, 8, 7], "max_tokens": 600, "ignore_eos": True, "return_token_ids": True})
            result["r"] = r

        th = threading.Thread(target=client)
        th.start()
        while httpx.get(url + "/health").json()["last_step_s"] is None:  # generating
            time.sleep(0.02)
        (worker,) = worker_processes(proc.pid)
        os.kill(worker, signal.SIGSTOP)
        t = time.monotonic()
        unavailable = []
        while time.monotonic() - t < 10:
            h = httpx.get(url + "/health")
            if h.status_code == 503:
                unavailable.append(h.json()["error"]["message"])
            elif h.json()["restarts"]:
                break
            time.sleep(0.05)
        th.join(120)
        health = httpx.get(url + "/health").json()
    finally:
        proc.kill()
    assert all("step_timeout_s=2" in m or "restarted" in m for m in unavailable), unavailable
    assert "did not finish a step within step_timeout_s=2" in health["last_failure"], health
    assert len(result["r"].json()["choices"][0]["token_ids"]) == 600
    assert health["restarts"] == 1 and health["step_timeout_s"] == 2


EXIT_WITHOUT_SHUTDOWN = """
import atexit, os, sys, threading

def running(pid):  # a live process, not a zombie waiting to be reaped
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

def after_the_engines_hook():  # atexit runs the last registered first
    if os.getpid() != PARENT:  # the forked child's exit
        return
    loops = [t for t in threading.enumerate() if t.name == LOOP_THREAD_NAME and t.is_alive()]
    print(f"loops={len(loops)} workers={sum(map(running, pids))}", flush=True)

PARENT = os.getpid()
atexit.register(after_the_engines_hook)  # before pat_engine registers its own
from pat_engine import Engine, SamplingParams
from pat_engine.core.loop_thread import LOOP_THREAD_NAME

engine = Engine(sys.argv[1], tp=1, dp=2, dtype="float64")
pids = engine.worker_pids()
params = SamplingParams(max_new_tokens=4)
first = engine.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids
child = os.fork()
if child == 0:  # a forked child exits the normal way (atexit runs): it must leave its parent's engine alone
    sys.exit(0)
os.waitpid(child, 0)
assert engine.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids == first
engine = None  # dropped, never shut down: its loop thread keeps it alive
"""


def test_an_engine_never_shut_down_is_stopped_before_the_interpreter_exits(model_dir):
    """A script that drops its engine without ``shutdown``: at exit the engine's loop thread and its workers are
    gone before the interpreter tears down its modules (a loop thread still polling then can crash the exit).
    A child forked from the script and exiting normally first leaves the engine alone: it does not try to shut
    it down (which, from the child, logs "engine shutdown: ..." and wakes the parent's loop) and the engine
    serves on."""
    proc = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_SHUTDOWN, model_dir("llama")], env=cli_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "loops=0 workers=0", proc.stdout + proc.stderr[-3000:]
    assert "engine shutdown" not in proc.stderr, proc.stderr[-3000:]
