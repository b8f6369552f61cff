"""Driver-side handle on the worker processes: start, message, watch, stop.

Workers are plain subprocesses (``python -m pat_engine.worker``, or on the CPU
forks of a warm fork server: core/worker_launch.py), each talking to the driver
over its own socketpair, so user scripts need no ``if __name__ == "__main__"``
guard. The driver hosts the rendezvous ``TCPStore`` on an OS-chosen port (no
fixed ports: engines run side by side). A worker that dies closes its socket,
so every wait notices at once and raises ``WorkerFailure`` instead of hanging.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import TypeVar

import torch.distributed as dist

from pat_engine.config import EngineConfig
from pat_engine.core.worker_launch import ForkedWorker, start_worker, uses_fork_server
from pat_engine.errors import WorkerFailure, last_traceback_line
from pat_engine.parallel.devices import DevicePlacement, visible_devices
from pat_engine.parallel.layout import Layout
from pat_engine.protocol import AnswerHeld, StepCommand, StepResult, WorkerArgs
from pat_engine.protocol.calls import Call, Reply, Shutdown, WorkerCall
import torch.multiprocessing  # noqa: F401  (registers the shared-memory pickling of tensors)

log = logging.getLogger(__name__)
R = TypeVar("R")
# what gloo says when the other end of a collective has gone; the rank that went is the failure to report
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer")
_PEER_DEATH_GRACE_S = 1.0  # how long such a reply waits for the death that caused it to be seen
_EXIT_STATUS_WAIT_S = 2.0  # how long a broken socket waits for its worker's exit code


class WorkerPool:
    def __init__(self, config: EngineConfig, layout: Layout, num_blocks: int, weights_path: str | None = None):
        self.config = config
        self._weights_path = weights_path or config.model
        self.world = config.world
        self.placement = DevicePlacement(self.world, visible_devices(config.device))
        self._layout, self._num_blocks = layout, num_blocks
        self.procs: list[subprocess.Popen | ForkedWorker] = []
        self.conns: list[Connection] = []
        self._store: dist.TCPStore | None = None
        self._call_ids = itertools.count(1)
        self.pending: list[StepResult | Reply] = []  # messages read while waiting for something else
        # calls already reported failed: the other ranks' late replies to them are dropped, not taken
        # for a failure of whatever runs when they arrive (a refusal on every rank is not a crash)
        self._failed_calls: set[int] = set()

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        for name, value in self.config.worker_env().items():  # OpenMP policy: see EngineConfig.worker_env
            env.setdefault(name, value)
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        fork = uses_fork_server(self.config.worker_launch, self.config.device)
        for rank in range(self.world):
            ours, theirs = socket.socketpair()
            try:
                proc, parent_pid = start_worker(theirs.fileno(), env, fork)
            finally:
                theirs.close()
            conn = Connection(ours.detach())
            args = WorkerArgs(rank, self.world, "127.0.0.1", self._store.port, self.config, self._layout,
                              self._num_blocks, parent_pid, self._weights_path, self.placement)
            self.procs.append(proc)
            self.conns.append(conn)
            # same authkey as the driver: tensors sent to workers then travel through shared memory
            conn.send_bytes(bytes(multiprocessing.current_process().authkey))
            conn.send(args)
        try:
            self._collect_replies(0, list(range(self.world)), self.config.worker_start_timeout_s, "start-up")
        except BaseException:
            self.kill()
            raise

    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def shutdown(self, timeout: float = 10.0) -> None:
        if not self.procs:
            return
        try:
            if self.alive():
                self.ask(Shutdown(timeout))
        except Exception as exc:  # already broken: fall through to kill
            log.debug("graceful worker shutdown failed: %s", exc)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not exit after SIGKILL", p.pid)
        for c in self.conns:
            c.close()
        self.procs, self.conns, self.pending = [], [], []
        self._store = None

    # ---- messaging ----------------------------------------------------------------------

    def send(self, ranks: list[int], msg: StepCommand | AnswerHeld | Call) -> None:
        # A step is pickled once for the whole group. A call may carry tensors, which travel as
        # shared-memory handles that each receiver consumes once, so it is pickled per rank.
        once = bytes(ForkingPickler.dumps(msg)) if isinstance(msg, (StepCommand, AnswerHeld)) else None
        for r in ranks:
            data = once if once is not None else bytes(ForkingPickler.dumps(msg))
            try:
                self.conns[r].send_bytes(data)
            except (BrokenPipeError, OSError) as exc:
                raise self._death(r, f"could not send to it: {exc}") from exc

    def ask(self, call: WorkerCall[R], ranks: list[int] | None = None) -> R:
        """Run ``call`` on ``ranks`` (default: all), wait for every one of them (``call.wait_s()``, else the
        step timeout) and answer as the call's ``reply`` rule says."""
        ranks = list(range(self.world)) if ranks is None else ranks
        call_id = next(self._call_ids)
        self.send(ranks, Call(call_id, call))
        replies = self._collect_replies(call_id, ranks, call.wait_s() or self.config.step_timeout_s,
                                        type(call).__name__)
        return call.reply.combine([replies[r].value for r in ranks])

    def poll(self, timeout: float | None, extra: list | None = None) -> list[StepResult | Reply]:
        """Messages that arrived within ``timeout``; raises ``WorkerFailure`` if a worker died.

        ``extra`` are more waitables (the engine's wake-up pipe) that end the wait early.
        """
        if self.pending:
            out, self.pending = self.pending, []
            return out
        return self._read(timeout, extra)

    def _read(self, timeout: float | None, extra: list | None = None) -> list[StepResult | Reply]:
        ready = wait(self.conns + list(extra or []), timeout)
        out = []
        for obj in ready:
            if isinstance(obj, Connection) and obj in self.conns:
                out.extend(self._drain(self.conns.index(obj)))
        if not out:
            self._check_alive()
        for msg in out:
            if isinstance(msg, Reply) and not msg.ok:
                self._blame_a_dead_peer(msg)
        return out

    def _drain(self, rank: int) -> list:
        msgs = []
        conn = self.conns[rank]
        try:
            while conn.poll():
                msg = conn.recv()
                if not (isinstance(msg, Reply) and msg.call_id in self._failed_calls):
                    msgs.append(msg)
        except (EOFError, OSError):
            # its end of the socket closed: the process is gone or going
            if msgs:
                # A worker that fails sends its reason, then exits: both can arrive in one read. Hand the
                # messages on first (the reason is in them); the closed socket raises on the next read.
                return msgs
            raise self._death(rank, "its socket closed") from None
        return msgs

    def _collect_replies(self, call_id: int, ranks: list[int], timeout: float, what: str) -> dict[int, Reply]:
        deadline = time.monotonic() + timeout
        got: dict[int, Reply] = {}
        while len(got) < len(ranks):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(ranks) - set(got))
                raise WorkerFailure(f"{what}: ranks {missing} did not answer within {timeout:.0f}s", rank=missing[0])
            for msg in self._read(min(left, 1.0)):
                if isinstance(msg, Reply) and msg.call_id == call_id:
                    if not msg.ok:
                        self._failed_calls.add(call_id)
                        raise WorkerFailure(f"{what} failed on rank {msg.rank}: {last_traceback_line(msg.error)}\n{msg.error}",
                                            rank=msg.rank, error_type=msg.error_type)
                    got[msg.rank] = msg
                elif isinstance(msg, Reply) and not msg.ok:
                    raise WorkerFailure(f"rank {msg.rank} failed: {last_traceback_line(msg.error)}\n{msg.error}", rank=msg.rank)
                else:
                    self.pending.append(msg)
        return got

    def _blame_a_dead_peer(self, reply: Reply) -> None:
        """Raise the death of a rank instead of ``reply``'s failure where that failure says a peer of a
        collective went away: a rank that exits mid-collective fails the others at once, and their replies
        can be read before its closed socket is."""
        if not any(words in (reply.error or "") for words in _PEER_GONE):
            return
        deadline = time.monotonic() + _PEER_DEATH_GRACE_S
        while True:
            self._check_alive()
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def _check_alive(self) -> None:
        for r, p in enumerate(self.procs):
            if p.poll() is not None:
                raise WorkerFailure(self._death_message(r, f"exit code {p.returncode}"), rank=r)

    def _death(self, rank: int, how_met: str) -> WorkerFailure:
        """The failure for a worker whose socket broke. The socket can break before the process is reaped (a
        forked worker's status comes through its fork server), so wait a moment for the exit code: it names
        the cause (-9: killed), where the broken socket only says that it is gone."""
        try:
            self.procs[rank].wait(_EXIT_STATUS_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        code = self.procs[rank].poll()
        detail = how_met if code is None else f"exit code {code} ({how_met})"
        return WorkerFailure(self._death_message(rank, detail), rank=rank)

    def _death_message(self, rank: int, detail: str) -> str:
        return f"worker rank {rank} (pid {self.procs[rank].pid}) died: {detail}"
