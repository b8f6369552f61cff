"""Running the app under uvicorn: in the foreground (the CLI) or in a background thread (tests, benchmarks).

The listening socket is bound here so that port 0 works: the OS picks a free
port and we can print it before uvicorn starts.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from fastapi import FastAPI


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def bound_port(sock: socket.socket) -> int:
    return sock.getsockname()[1]


def _server(app: FastAPI, log_level: str, graceful_s: float) -> uvicorn.Server:
    config = uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=graceful_s, lifespan="on")
    return uvicorn.Server(config)


def run_foreground(app: FastAPI, sock: socket.socket, log_level: str = "warning", graceful_s: float = 5.0) -> None:
    """Serve until SIGINT/SIGTERM; uvicorn then stops taking connections and runs the app's shutdown."""
    _server(app, log_level, graceful_s).run(sockets=[sock])


class BackgroundServer:
    """``with BackgroundServer(app) as srv: httpx.get(srv.url + "/health")`` on a free loopback port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = bind_socket(host, port)
        self.url = f"http://{host}:{bound_port(self.sock)}"
        self.server = _server(app, log_level, graceful_s=2.0)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="pat-serve-http", daemon=True)

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
