"""The engine loop thread: the only thread that talks to workers.

API calls from any thread (``generate``, ``reconfigure``, aborts, the HTTP
server) are posted here as closures and run between steps, so the worker
pipes and the coordinator's state need no locks. A wake-up pipe ends the
loop's wait early when a call is posted.

Worker failures are handled here too: the world is restarted and the
unfinished requests are recomputed (same tokens, since sampling depends only
on seed and position), or, when recovery is off or exhausted, the requests
end with finish reason "error" and the world is still restarted so the
engine keeps serving.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

from pat_engine.core.coordinator import GlobalCoordinator
from pat_engine.core.served_weights import ServedWeights
from pat_engine.core.timeline import SwitchEvent
from pat_engine.core.worker_pool import WorkerPool
from pat_engine.errors import EngineClosedError, WorkerFailure

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, coordinator: GlobalCoordinator, make_pool: Callable[[], WorkerPool], max_restarts: int,
                 recover: bool, weights: ServedWeights):
        self.coordinator = coordinator
        self._make_pool = make_pool
        self.max_restarts = max_restarts
        self.recover = recover
        self.restarts = 0
        self.weights = weights  # a restart reloads them from disk, which loses in-memory updates
        self.failures: list[str] = []
        self._inbox: deque[tuple[Callable, tuple, Future]] = deque()
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._stop = False
        self.dead: str | None = None
        self._thread = threading.Thread(target=self._run, name="pat-engine-loop", daemon=True)
        self._thread.start()

    # ---- posting work -----------------------------------------------------------------------

    def call(self, fn: Callable, *args: Any) -> Future:
        fut: Future = Future()
        if self._stop or not self._thread.is_alive():
            fut.set_exception(EngineClosedError("the engine has been shut down"))
            return fut
        self._inbox.append((fn, args, fut))
        self._wake()
        return fut

    def run(self, fn: Callable, *args: Any, timeout: float | None = None) -> Any:
        return self.call(fn, *args).result(timeout)

    def _wake(self) -> None:
        try:
            self._wake_w.send_bytes(b"!")
        except OSError:
            pass

    def stop(self, timeout: float = 30.0) -> None:
        if self._stop:
            return
        done = self.call(self._shutdown)
        try:
            done.result(timeout)
        except Exception as exc:
            log.warning("engine shutdown: %s", exc)
        self._stop = True
        self._wake()
        self._thread.join(timeout)
        if self.coordinator.pool is not None:
            self.coordinator.pool.kill()

    def _shutdown(self) -> None:
        self.coordinator.abort([s.seq_id for s in self.coordinator.unfinished()], "abort", "engine shut down")
        self.coordinator.pool.shutdown()
        self._stop = True

    # ---- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop:
            self._drain_wake()
            while self._inbox:
                fn, args, fut = self._inbox.popleft()
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as exc:  # delivered to the caller
                        fut.set_exception(exc)
                if self._stop:
                    break
            if self._stop:
                break
            try:
                if self.dead is None:
                    self.coordinator.tick(0.5, self._wake_r)
                else:
                    self._wake_r.poll(0.5)
            except WorkerFailure as exc:
                self._on_failure(exc)
            except Exception as exc:  # a bug in the driver: fail requests loudly rather than hang
                log.exception("engine loop error")
                self._on_failure(WorkerFailure(f"engine loop error: {exc!r}"))
        for fn, args, fut in self._inbox:
            fut.set_exception(EngineClosedError("the engine has been shut down"))

    def _drain_wake(self) -> None:
        while self._wake_r.poll():
            self._wake_r.recv_bytes()

    def _on_failure(self, exc: WorkerFailure) -> None:
        coord = self.coordinator
        message = str(exc).splitlines()[0]
        self.failures.append(str(exc))
        log.error("worker failure: %s", message)
        coord.pool.kill()
        affected = coord.unfinished()
        self.restarts += 1
        can_restart = self.restarts <= self.max_restarts
        coord.timeline.add_switch(SwitchEvent(coord.timeline.now(), str(coord.layout), str(coord.memory.base),
                                              f"worker failure: {message}", "recompute", 0.0, ok=False, error=message))
        requeue = self.recover and can_restart and self.weights.on_disk
        if not requeue:
            reason = "worker failure" if can_restart else "worker failure (restart budget used up)"
            coord.abort([s.seq_id for s in affected], "error", f"{reason}: {message}")
        if not can_restart:
            self.dead = f"workers failed and the restart budget ({self.max_restarts}) is used up: {message}"
            return
        try:
            pool = self._make_pool()
        except Exception as start_exc:
            coord.abort([s.seq_id for s in coord.unfinished()], "error", f"restart failed: {start_exc}")
            self.dead = f"could not restart workers after a failure: {start_exc}"
            return
        coord.reset(pool, coord.memory.base)
        self.weights.workers_restarted()  # after in-memory updates: refuse new requests until they come again
        if requeue and affected:
            log.warning("restarted workers; %d unfinished requests will be recomputed", len(affected))
