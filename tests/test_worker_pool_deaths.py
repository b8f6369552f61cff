"""A worker's death is named by its exit code even when the driver meets its broken socket first."""
import socket
import subprocess
from multiprocessing.connection import Connection

import pytest

from pat_engine.core.worker_pool import WorkerPool
from pat_engine.errors import WorkerFailure
from pat_engine.protocol import AnswerHeld


class ReapedLate:
    """A killed worker whose exit code is known only once the driver waits for it (a forked worker's status
    comes through its fork server, a moment after its socket closed)."""

    pid = 4242

    def __init__(self, code: int | None):
        self.code, self.returncode = code, None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.code is None:  # as Popen and ForkedWorker: no status within the timeout
            raise subprocess.TimeoutExpired("worker", timeout)
        self.returncode = self.code
        return self.code


def _pool_with_a_dead_rank(code: int | None) -> WorkerPool:
    ours, theirs = socket.socketpair()
    theirs.close()  # the worker's end is gone
    pool = WorkerPool.__new__(WorkerPool)
    pool.procs, pool.conns, pool.pending, pool._failed_calls = [ReapedLate(code)], [Connection(ours.detach())], [], set()
    return pool


def test_a_send_to_a_killed_worker_reports_its_signal():
    with pytest.raises(WorkerFailure) as failure:
        _pool_with_a_dead_rank(-9).send([0], AnswerHeld(step_id=1))
    assert "rank 0 (pid 4242) died: exit code -9 (could not send to it" in str(failure.value)
    assert failure.value.rank == 0


def test_a_read_from_a_killed_worker_reports_its_signal():
    with pytest.raises(WorkerFailure) as failure:
        _pool_with_a_dead_rank(-9)._drain(0)
    assert "rank 0 (pid 4242) died: exit code -9 (its socket closed)" in str(failure.value)


def test_a_worker_not_yet_reaped_is_reported_by_what_the_driver_met():
    with pytest.raises(WorkerFailure) as failure:
        _pool_with_a_dead_rank(None).send([0], AnswerHeld(step_id=1))
    assert "rank 0 (pid 4242) died: could not send to it" in str(failure.value)
