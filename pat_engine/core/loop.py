"""The engine loop: the body of the one thread that talks to workers (``LoopThread``).

Each turn runs the calls other threads posted (``loop_thread.py``), then one
``GlobalCoordinator.tick``: a due switch, steps dispatched, results handled.

Worker failures are handled here too: the world is restarted and the
unfinished requests are recomputed (same tokens, since sampling depends only
on seed and position), or, when recovery is off, the requests end with
finish reason "error" and the world is still restarted so the engine keeps
serving. The requests of the failing step are replayed one at a time and a
request whose step fails twice is failed alone (``Quarantine``). Restarts
are a rate (``RestartBudget``): when a window's allowance is used up, or a
restart itself fails, the engine is dead: ``dead`` says why, every request
is ended with that error, and new ones are refused at once.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from pat_engine.core.coordinator import GlobalCoordinator
from pat_engine.core.loop_thread import on_loop
from pat_engine.core.quarantine import Quarantine
from pat_engine.core.request import Sequence
from pat_engine.core.restart_budget import RestartBudget
from pat_engine.core.served_weights import ServedWeights
from pat_engine.core.worker_pool import WorkerPool
from pat_engine.errors import EngineDeadError, WorkerFailure
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.policy import SwitchPolicy

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, coordinator: GlobalCoordinator, make_pool: Callable[[], WorkerPool], budget: RestartBudget,
                 recover: bool, weights: ServedWeights):
        self.coordinator = coordinator
        self.thread = coordinator.thread
        self._make_pool = make_pool
        self.budget = budget
        self.recover = recover
        self.restarts = 0  # over the engine's life (the budget counts the recent ones)
        self.restarting = False  # True while a failed world is being replaced (for /health)
        self.quarantine = Quarantine()
        self.weights = weights  # a restart reloads them from disk, which loses in-memory updates
        self.failures: list[str] = []
        self.dead: str | None = None
        self.thread.start(self._run)

    def stop(self, timeout: float = 30.0) -> None:
        thread = self.thread
        if thread.stopping:
            return
        done = thread.call(self._shutdown)
        try:
            done.result(timeout)
        except Exception as exc:
            log.warning("engine shutdown: %s", exc)
        thread.stopping = True
        thread.wake()
        thread.join(timeout)
        if self.coordinator.stepping.pool is not None:
            self.coordinator.stepping.pool.kill()

    def _shutdown(self) -> None:
        stepping = self.coordinator.stepping
        stepping.finish_unfinished("abort", "engine shut down")
        self.finish_parked(self.quarantine.take_parked(), "abort", "engine shut down")
        stepping.pool.shutdown()
        self.thread.stopping = True

    # ---- admission and state (run in the loop thread unless noted) -------------------------------

    @on_loop
    def admit(self, samples: list[Sequence]) -> None:
        """Queue the samples of one prompt, noting the weight version they start under; refused here,
        in the loop thread, so none slips in after the engine died."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        for seq in samples:
            seq.start_on_weights(self.weights.version)
        self.coordinator.stepping.add_samples(samples)

    @on_loop
    def start_batch(self, families: list[list[Sequence]], policy: SwitchPolicy | None,
                    base_layout: Layout | None) -> None:
        """A new stage and its requests in one loop turn, so no step runs before all are queued."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self.coordinator.switching.start_stage(policy, base_layout)
        for family in families:
            self.admit(family)

    @on_loop
    def abort_requests(self, request_ids: set[str]) -> int:
        """Stop the unfinished requests with these ids, queued or held back by the quarantine; they
        finish with reason "abort" and keep what they generated. Returns how many."""
        stepping = self.coordinator.stepping
        ids = [s.seq_id for s in stepping.unfinished() if s.request_id in request_ids]
        held = [s for s in self.quarantine.parked() if s.request_id in request_ids and not s.finished]
        self.finish_parked(held, "abort", "aborted by the caller")
        return len(stepping.abort(ids, "abort", "aborted by the caller")) + len(held)

    def finish_parked(self, seqs: list[Sequence], reason: str, error: str | None) -> None:
        """End requests held back by the quarantine (they are in no queue of the coordinator)."""
        for seq in seqs:
            if not seq.finished:
                seq.finish(reason, error)
                if seq.on_update is not None:
                    seq.on_update(seq, 0)

    def health(self) -> dict:
        """A snapshot for /health; read from any thread (plain attribute reads, no loop round trip,
        so it answers while the loop is busy or stuck)."""
        stepping = self.coordinator.stepping
        now = time.monotonic()
        pool = stepping.pool
        flights = list(stepping.inflight.values())
        return {
            "dead": self.dead,
            "restarting": self.restarting,
            "workers_alive": bool(pool is not None and pool.alive()),
            "oldest_step_s": round(now - min(f.sent_at for f in flights), 3) if flights else None,
            "last_step_s": None if stepping.last_step_at is None else round(now - stepping.last_step_at, 3),
            "step_timeout_s": stepping.config.step_timeout_s,
            "restarts": self.restarts,
            "last_failure": self.failures[-1] if self.failures else None,  # why the last restart happened
            "restarts_in_window": self.budget.recent(),
            "restart_budget": self.budget.describe(),
        }

    # ---- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        thread = self.thread
        try:
            while not thread.stopping:
                thread.run_posted(self._on_failure)  # e.g. reconfigure()'s switch failing on a worker
                if thread.stopping:
                    break
                try:
                    if self.dead is None:
                        self._admit_held()
                        self.coordinator.tick(0.5, thread.wake_handle)
                    else:
                        thread.wake_handle.poll(0.5)
                except WorkerFailure as exc:
                    self._on_failure(exc)
                except Exception as exc:  # a bug in the driver: fail requests loudly rather than hang
                    log.exception("engine loop error")
                    self._on_failure(WorkerFailure(f"engine loop error: {exc!r}"))
        except BaseException as exc:  # the recovery itself failed: say so to every later caller
            self.dead = self.dead or f"the engine loop stopped: {exc!r}"
            raise
        finally:
            thread.close()  # what is still posted fails as the engine being shut down

    def _admit_held(self) -> None:
        seq = self.quarantine.next_to_admit()
        if seq is not None:
            log.warning("replaying request %s alone after a failed step", seq.request_id)
            self.coordinator.stepping.add(seq)

    def _on_failure(self, exc: WorkerFailure) -> None:
        message = str(exc).splitlines()[0]
        self.failures.append(str(exc))
        log.error("worker failure: %s", message)
        self.restarting = True
        try:
            self._recover(exc, message)
        finally:
            self.restarting = False

    def _recover(self, exc: WorkerFailure, message: str) -> None:
        coord, stepping = self.coordinator, self.coordinator.stepping
        suspects = stepping.step_members(exc.rank)  # read before the world is torn down
        stepping.pool.kill()
        self.restarts += 1
        can_restart = self.budget.take()
        coord.switching.record_failure(message)
        requeue = self.recover and can_restart and self.weights.on_disk
        held: list[Sequence] = []
        if requeue:
            poison, held = self.quarantine.on_crash(suspects)
            if poison:
                log.error("failing %d request(s) whose step failed twice: %s", len(poison),
                          ", ".join(s.request_id for s in poison))
                stepping.abort([s.seq_id for s in poison], "error",
                               f"this request's step made a worker fail twice ({message}); it was failed alone and "
                               "the engine goes on with the others")
            self.quarantine.park(stepping.withdraw([s.seq_id for s in held]))
        else:
            if not can_restart:  # set first: a caller woken by the aborts below must see why
                self.dead = (f"the engine cannot serve: workers failed more often than the restart budget allows "
                             f"({self.budget.describe()}); last failure: {message}")
            reason = "worker failure" if can_restart else "worker failure (restart budget used up)"
            stepping.finish_unfinished("error", f"{reason}: {message}")
            self.finish_parked(self.quarantine.take_parked(), "error", f"{reason}: {message}")
        if not can_restart:
            return
        try:
            pool = self._make_pool()
        except Exception as start_exc:
            self.dead = f"the engine cannot serve: could not restart workers after a failure: {start_exc}"
            stepping.finish_unfinished("error", self.dead)
            self.finish_parked(self.quarantine.take_parked(), "error", self.dead)
            return
        coord.restart(pool)
        self.weights.workers_restarted()  # after in-memory updates: refuse new requests until they come again
        if requeue and (stepping.unfinished() or held):
            log.warning("restarted workers; %d unfinished requests will be recomputed (%d of them one at a time)",
                        len(stepping.unfinished()) + len(held), len(held))
