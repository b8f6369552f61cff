"""Starting a worker process: a fresh interpreter, or a fork of a warm one (worker/fork_server.py).

A fresh ``python -m pat_engine.worker`` imports torch and the worker's modules before it can join the world;
an engine of four ranks on two cores waits for four of them (3.86 s to start, against 0.35 s forked:
bench/results/engine_start.md). On the CPU the
driver keeps a fork server per worker environment (started by the first engine that needs it, reused by
every later one and by restarts after a failure) and each worker is forked from it in milliseconds.
``EngineConfig.worker_launch``: "auto" forks CPU workers; GPU workers always start as fresh interpreters
(a process forked after CUDA was touched cannot use it, and one import per rank is small beside loading
its weights); "fresh" starts CPU workers that way too. A server that fails to start or to fork is dropped
and replaced once, then the worker starts fresh with a warning: the engine starts either way.

Memory: an idle server holds what its imports take (227 MB resident with torch 2.13); its workers share
those pages copy-on-write, so a forked worker's proportional set is 79-113 MB below a fresh one's and from
two or three workers the server pays for itself (bench/results/engine_start.md).

``ForkedWorker`` answers what ``WorkerPool`` asks of a ``subprocess.Popen`` (``pid``, ``poll``, ``wait``,
``kill``, ``returncode``); the exit code comes from the server, which reaps its children.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict

from pat_engine.protocol.startup import FORK_MAX_MESSAGE, FORK_STATUS, FORK_VOLATILE_ENV, LaunchRequest

log = logging.getLogger(__name__)

_MAX_SERVERS = 3  # environments kept warm; an idle one beyond that is closed
_READY_TIMEOUT_S = 120.0  # a server's imports on a loaded host


class ForkedWorker:
    """A worker forked by a fork server, with the part of ``subprocess.Popen``'s interface the pool uses.

    Like ``Popen``, it may be asked from several threads at once (``/health`` polls while the engine loop
    waits for a dead worker's code): one thread at a time reads and closes the status pipe, and a ``poll``
    that meets a read in progress answers None (not known yet) instead of waiting for it.
    """

    def __init__(self, pid: int, status_fd: int, server_pid: int):
        self.pid, self.args = pid, ["fork_server", str(server_pid)]  # args: what TimeoutExpired names
        self.returncode: int | None = None
        self._status = status_fd
        self._reading = threading.Lock()

    def poll(self) -> int | None:
        return self._read_status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read_status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _read_status(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        start = time.monotonic()
        if not (self._reading.acquire(blocking=False) if timeout == 0.0
                else self._reading.acquire(timeout=-1 if timeout is None else timeout)):
            return self.returncode  # another thread is reading it
        try:
            if self.returncode is None:
                left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
                self._read_status_pipe(left)
            return self.returncode
        finally:
            self._reading.release()

    def _read_status_pipe(self, timeout: float | None) -> None:
        """Sets ``returncode`` once the server has written it (call with ``_reading`` held)."""
        ready, _, _ = select.select([self._status], [], [], timeout)
        if not ready:
            return
        data = os.read(self._status, FORK_STATUS.size)
        if len(data) == FORK_STATUS.size:
            code = FORK_STATUS.unpack(data)[0]
        else:  # the server died before reaping it: make sure it is gone, and say how
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            code = -signal.SIGKILL
        self.returncode = code  # before the close: a reader that sees it never touches the closed fd
        os.close(self._status)

    def __del__(self) -> None:
        if self.returncode is None:
            try:
                os.close(self._status)
            except OSError:
                pass


class ForkServer:
    """The driver's end of one fork server process."""

    def __init__(self, env: dict[str, str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-m", "pat_engine.worker.fork_server", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), env=env, close_fds=True)
        theirs.close()
        self.sock, self.pid = ours, self.proc.pid
        self.lock = threading.Lock()
        self.launched: list[ForkedWorker] = []
        self._reply(_READY_TIMEOUT_S)

    def launch(self, conn_fd: int, env: dict[str, str]) -> ForkedWorker:
        streams = [s for s in ("0", "1", "2") if _is_open(int(s))]
        status_r, status_w = os.pipe()
        try:
            with self.lock:
                request = LaunchRequest(env, os.getcwd(), ("conn", "status", *streams))
                socket.send_fds(self.sock, [pickle.dumps(request)], [conn_fd, status_w, *map(int, streams)])
                pid = self._reply(30.0)["pid"]
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        worker = ForkedWorker(pid, status_r, self.pid)
        self.launched = [w for w in self.launched if w.returncode is None] + [worker]
        return worker

    def idle(self) -> bool:
        return all(w.poll() is not None for w in self.launched)

    def close(self) -> None:
        """Stop the server (it kills any child still running)."""
        self.sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _reply(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise RuntimeError(f"the worker fork server (pid {self.pid}) did not answer "
                                   f"(exit code {self.proc.poll()})")
            ready, _, _ = select.select([self.sock], [], [], min(left, 1.0))
            if ready:
                data = self.sock.recv(FORK_MAX_MESSAGE)
                if not data:
                    raise RuntimeError(f"the worker fork server (pid {self.pid}) closed its socket")
                reply = pickle.loads(data)
                if "error" in reply:
                    raise RuntimeError(f"the worker fork server could not fork: {reply['error']}")
                return reply


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


_servers: OrderedDict[tuple, ForkServer] = OrderedDict()  # by environment, most recently used last
_servers_lock = threading.Lock()


def _forget_servers_in_child() -> None:
    """A forked driver must not send to its parent's servers; dropping them closes only this copy."""
    global _servers_lock
    _servers.clear()
    _servers_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_servers_in_child)


def _server_for(env: dict[str, str]) -> ForkServer:
    key = tuple(sorted((k, v) for k, v in env.items() if k not in FORK_VOLATILE_ENV))
    with _servers_lock:
        server = _servers.get(key)
        if server is not None and server.proc.poll() is None:
            _servers.move_to_end(key)
            return server
        server = _servers[key] = ForkServer(env)
        for old_key in [k for k, s in _servers.items() if k != key][: max(0, len(_servers) - _MAX_SERVERS)]:
            if _servers[old_key].idle():
                _servers.pop(old_key).close()
        return server


def _drop(server: ForkServer) -> None:
    with _servers_lock:
        for key, s in list(_servers.items()):
            if s is server:
                del _servers[key]
    try:
        server.close()
    except Exception:
        pass


def uses_fork_server(mode: str, device: str) -> bool:
    """Whether workers of an engine on ``device`` with ``EngineConfig.worker_launch == mode`` are forked."""
    return mode == "auto" and device == "cpu"


def start_worker(conn_fd: int, env: dict[str, str], fork: bool) -> tuple[subprocess.Popen | ForkedWorker, int]:
    """A worker process serving the driver socket ``conn_fd``, and the pid of its parent (the driver, or the
    fork server): the worker exits when its parent does. A fork server that fails is replaced once (it may
    have been killed since the last engine started), then the worker starts fresh."""
    for attempt in range(2 if fork else 0):
        server = None
        try:
            server = _server_for(env)
            return server.launch(conn_fd, env), server.pid
        except Exception as exc:
            if server is not None:
                _drop(server)
            if attempt:
                log.warning("starting a fresh worker process: the fork server failed (%s)", exc)
    proc = subprocess.Popen([sys.executable, "-m", "pat_engine.worker", str(conn_fd)],
                            pass_fds=(conn_fd,), env=env, close_fds=True)
    return proc, os.getpid()
