"""Running the app under uvicorn: in the foreground (the CLI) or in a background thread (tests, benchmarks).

The listening socket is bound here so that port 0 works: the OS picks a free
port and we can print it before uvicorn starts.

On SIGTERM/SIGINT uvicorn stops accepting connections and waits for the open
ones; ``on_exit`` (the server's drain) runs first, and uvicorn's own grace
period is the drain timeout plus a margin, so streams cut off at the drain
timeout still get their closing events before uvicorn gives up on them.
A ``watch`` callable that returns a reason stops the server the same way
(the engine died): ``run_foreground`` then returns that reason.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable

import uvicorn
from fastapi import FastAPI

log = logging.getLogger(__name__)
CLOSE_MARGIN_S = 3.0  # after the drain timeout: time for cut-off streams to send their last events


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def bound_port(sock: socket.socket) -> int:
    return sock.getsockname()[1]


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when a stop begins (uvicorn only tells it at the very end)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None] | None):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        if self._on_exit is not None:
            try:
                self._on_exit()
            except Exception:
                log.exception("drain start failed")
        super().handle_exit(sig, frame)


def _server(app: FastAPI, log_level: str, graceful_s: float, on_exit: Callable[[], None] | None = None) -> _Server:
    config = uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=graceful_s, lifespan="on")
    return _Server(config, on_exit)


def run_foreground(app: FastAPI, sock: socket.socket, log_level: str = "warning", drain_s: float = 20.0,
                   on_exit: Callable[[], None] | None = None,
                   watch: Callable[[], str | None] | None = None) -> str | None:
    """Serve until SIGINT/SIGTERM, or until ``watch()`` gives a reason to stop (returned, else None)."""
    server = _server(app, log_level, drain_s + CLOSE_MARGIN_S, on_exit)
    reason: list[str] = []
    if watch is not None:
        def poll() -> None:
            while not server.should_exit:
                why = watch()
                if why is not None:
                    reason.append(why)
                    log.error("stopping the server: %s", why)
                    if on_exit is not None:
                        on_exit()
                    server.should_exit = True  # not handle_exit: uvicorn re-raises the signals it was given
                    return
                time.sleep(0.5)

        threading.Thread(target=poll, name="pat-serve-watch", daemon=True).start()
    server.run(sockets=[sock])
    return reason[0] if reason else None


class BackgroundServer:
    """``with BackgroundServer(app) as srv: httpx.get(srv.url + "/health")`` on a free loopback port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 graceful_s: float = 2.0, on_exit: Callable[[], None] | None = None):
        self.sock = bind_socket(host, port)
        self.url = f"http://{host}:{bound_port(self.sock)}"
        self.server = _server(app, log_level, graceful_s, on_exit)
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
