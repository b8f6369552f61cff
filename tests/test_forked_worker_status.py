"""A forked worker's exit status read from two threads at once (core/worker_launch.py's ``ForkedWorker``):
``/health`` polls the pool while the engine loop waits for a dead worker's code. Only one thread may read
and close the status pipe; the other must never read a closed (or reused) descriptor."""

from __future__ import annotations

import os
import threading
import time

import pytest

from pat_engine.core import worker_launch
from pat_engine.core.worker_launch import ForkedWorker
from pat_engine.protocol.startup import FORK_STATUS


@pytest.fixture
def status_pipe():
    read_fd, write_fd = os.pipe()
    yield read_fd, write_fd
    os.close(write_fd)


def test_a_poll_during_a_wait_never_reads_the_closed_pipe(status_pipe, monkeypatch):
    """The order CI met: the loop thread's wait() is between its select and its read when /health polls.
    The poll must answer "not known yet", then the code once the wait has it."""
    read_fd, write_fd = status_pipe
    worker = ForkedWorker(pid=os.getpid(), status_fd=read_fd, server_pid=0)
    in_read, real_read = threading.Event(), os.read

    def slow_read(fd: int, n: int) -> bytes:
        in_read.set()
        time.sleep(0.2)  # the other thread's select sees the same bytes ready meanwhile
        return real_read(fd, n)

    monkeypatch.setattr(worker_launch.os, "read", slow_read)
    os.write(write_fd, FORK_STATUS.pack(-9))
    codes: list[int] = []
    waiter = threading.Thread(target=lambda: codes.append(worker.wait(5)))
    waiter.start()
    assert in_read.wait(5)
    assert worker.poll() is None  # the wait is reading it
    waiter.join(5)
    assert codes == [-9]
    assert worker.poll() == -9 and worker.wait(0) == -9


def test_a_wait_behind_another_wait_gets_the_code(status_pipe):
    read_fd, write_fd = status_pipe
    worker = ForkedWorker(pid=os.getpid(), status_fd=read_fd, server_pid=0)
    codes: list[int] = []
    waiters = [threading.Thread(target=lambda: codes.append(worker.wait(5))) for _ in range(4)]
    for w in waiters:
        w.start()
    time.sleep(0.05)
    os.write(write_fd, FORK_STATUS.pack(3))
    for w in waiters:
        w.join(5)
    assert codes == [3, 3, 3, 3]


def test_a_wait_with_no_code_times_out(status_pipe):
    read_fd, _ = status_pipe
    worker = ForkedWorker(pid=os.getpid(), status_fd=read_fd, server_pid=0)
    assert worker.poll() is None
    with pytest.raises(Exception, match="timed out"):
        worker.wait(0.05)
