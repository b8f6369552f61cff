"""The fork server: one warm interpreter that forks CPU worker processes on request.

``python -m pat_engine.worker.fork_server <socket fd>``, started by the driver (core/worker_launch.py).
It imports what a worker imports (torch and the worker's modules: most of a fresh worker's start) once,
then serves launch requests until its socket closes. Each request is a
datagram: a pickled ``LaunchRequest`` (protocol/startup.py) with its file descriptors (the worker's end
of the driver socketpair, the write end of an exit-status pipe, and the driver's stdin, stdout and
stderr). The forked child takes the driver's environment, working directory and standard streams, as a
process ``subprocess.Popen`` started then would have, and runs ``worker_main``; when it exits, the
server writes its exit code (``Popen.returncode``'s convention: -N for signal N) into the status pipe.

The server stays single-threaded (forking a process with other threads copies their locks, held or
not) and never runs a torch op, so no OpenMP pool or device context exists when it forks. Variables
read when a library loads (OpenMP's, glibc's tunables) come from the server's own environment: the
driver keeps one server per environment, ignoring only variables that change between calls and that
nothing reads at load time (``FORK_VOLATILE_ENV``, protocol/startup.py). If the driver goes away (its
socket closes) the server kills its children, as a worker whose driver died exits (worker/worker.py
``_watch_parent``; a forked worker watches the server, its parent).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import sys
import traceback

from pat_engine.protocol.startup import FORK_MAX_MESSAGE, FORK_STATUS, LaunchRequest


def main(control_fd: int) -> None:
    control = socket.socket(fileno=control_fd)
    for fd in (0, 1, 2):  # a standard stream the driver had closed: hold its number, so that no file
        try:  # descriptor received later lands there and is overwritten by a child's dup2
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
    import pat_engine.worker.worker  # noqa: F401  (the preload: what every forked worker would import)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the driver; it stops the workers
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up byte is written
    server = _Server(control, (wake_r, wake_w))
    control.send(pickle.dumps({"pid": os.getpid()}))  # ready
    server.serve()


class _Server:
    def __init__(self, control: socket.socket, wake: tuple[int, int]):
        self.control, self.wake = control, wake
        self.children: dict[int, int] = {}  # pid -> write end of its status pipe

    def serve(self) -> None:
        while True:
            ready, _, _ = select.select([self.control, self.wake[0]], [], [])
            if self.wake[0] in ready:
                os.read(self.wake[0], 4096)
                self.reap()
            if self.control in ready:
                msg, fds, _, _ = socket.recv_fds(self.control, FORK_MAX_MESSAGE, 8)
                if not msg:  # the driver went away
                    break
                self.launch(pickle.loads(msg), fds)
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while self.children:
            self.reap(block=True)

    def launch(self, request: LaunchRequest, fds: list[int]) -> None:
        named = dict(zip(request.names, fds))
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            self.control.send(pickle.dumps({"error": f"fork failed: {exc}"}))
            return
        if pid == 0:
            self.become_worker(request, named)  # never returns
        for name, fd in named.items():
            if name != "status":
                os.close(fd)
        self.children[pid] = named["status"]
        self.control.send(pickle.dumps({"pid": pid}))

    def reap(self, block: bool = False) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            fd = self.children.pop(pid, None)
            if fd is not None:
                try:
                    os.write(fd, FORK_STATUS.pack(os.waitstatus_to_exitcode(status)))
                except OSError:  # the driver closed its end: nobody is waiting for this code
                    pass
                os.close(fd)
            if block:
                return

    def become_worker(self, request: LaunchRequest, named: dict[str, int]) -> None:
        """In the child: drop the server's state, take the driver's streams, environment and directory,
        and run the worker."""
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.control.close()
            for fd in (*self.wake, *self.children.values(), named["status"]):
                os.close(fd)
            for stream in ("0", "1", "2"):
                if stream in named:
                    os.dup2(named[stream], int(stream))
                    os.close(named[stream])
            os.chdir(request.cwd)
            os.environ.clear()
            os.environ.update(request.env)
            from multiprocessing.connection import Connection

            from pat_engine.worker.worker import worker_main

            worker_main(Connection(named["conn"]))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            _exit(code)


def _exit(code: int) -> None:
    """End a forked worker the way a fresh interpreter's exit would (its exit hooks, flushed streams),
    without unwinding into the server's loop."""
    try:
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    main(int(sys.argv[1]))
