"""pat-serve instances behind an sglang-router, all on loopback with ports the OS picks.

Used by the router test and the router benchmark (pytest puts ``bench/`` on the path; ``free_port``
also serves the collectives test and benchmark), and a runnable picture of
the multi-node recipe (docs/integrations.md) on one machine::

    with PatServeProcess(model, world=1) as a, PatServeProcess(model, world=1) as b, \\
            SGLangRouter([a.url, b.url]) as router:
        httpx.post(router.url + "/generate", json={...})

The router is the ``sglang-router`` wheel (Rust, no torch); it is started as
``python -m sglang_router.launch_router``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port the OS picks (for a process that cannot be told to bind port 0 itself)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


class _Subprocess:
    """A child process (``self.proc``) stopped with SIGTERM, then SIGKILL after ``stop_timeout_s``."""

    proc: subprocess.Popen
    stop_timeout_s = 15.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class PatServeProcess(_Subprocess):
    """``python -m pat_engine.serve serve`` on port 0; ``url`` is read from its start-up line."""

    stop_timeout_s = 30.0  # a server drains its requests first

    def __init__(self, model: str, world: int = 1, tp: int = 1, dtype: str = "float32", *extra: str,
                 start_timeout_s: float = 300.0):
        cmd = [sys.executable, "-m", "pat_engine.serve", "serve", "--model", model, "--world", str(world),
               "--tp", str(tp), "--dtype", dtype, "--host", LOOPBACK, "--port", "0", *extra]
        self.proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        self.url = self._wait_url(start_timeout_s)
        threading.Thread(target=self._drain, daemon=True).start()  # keep the pipe from filling up

    def _wait_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError("pat-serve exited at start:\n" + "".join(self.log))
            self.log.append(line)
            if " on http://" in line:
                return line.strip().rsplit(" on ", 1)[1]
        raise RuntimeError("pat-serve did not start in time:\n" + "".join(self.log))

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)



class SGLangRouter(_Subprocess):
    """``sglang_router.launch_router`` in front of ``worker_urls`` (round robin unless told otherwise)."""

    def __init__(self, worker_urls: list[str], policy: str = "round_robin", start_timeout_s: float = 120.0):
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", LOOPBACK, "--port", str(self.port),
               "--policy", policy, "--log-level", "warn", "--worker-urls", *worker_urls]
        self.proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        self._wait_ready(len(worker_urls), start_timeout_s)

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def _wait_ready(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("sglang-router exited:\n" + "".join(self.log))
            try:
                if len(self.workers()) >= n:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("sglang-router did not become ready:\n" + "".join(self.log))

    def workers(self) -> list[dict]:
        """The router's worker list (``GET /workers``, sglang-router >= 0.3)."""
        return httpx.get(self.url + "/workers", timeout=10).json()["workers"]

    def add_worker(self, url: str) -> None:
        httpx.post(self.url + "/workers", json={"url": url, "worker_type": "regular"}, timeout=30).raise_for_status()

    def remove_worker(self, url: str) -> None:
        for w in self.workers():
            if w["url"] == url:
                httpx.delete(f"{self.url}/workers/{w['id']}", timeout=30).raise_for_status()
                return
        raise KeyError(f"{url} is not a worker of the router")

