"""``LoopThread``: the one thread that owns the driver's state, and the way into it from any other.

Calls from any thread (``generate``, ``reconfigure``, aborts, the HTTP server) are posted here
as closures and run between steps, so the worker pipes and the services' state need no locks.
A wake-up pipe ends the loop's wait early when a call is posted.

``on_loop`` marks a service method that touches that state: called from another thread it is
posted and waited for (its value or its exception comes back to the caller); called in the loop
thread, or before the loop has started (tests that drive a coordinator by hand), it runs at once.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

from pat_engine.errors import EngineClosedError, WorkerFailure

F = TypeVar("F", bound=Callable[..., Any])

LOOP_THREAD_NAME = "pat-engine-loop"


class LoopThread:
    def __init__(self) -> None:
        self._inbox: deque[tuple[Callable, tuple, Future]] = deque()
        self.wake_handle, self._wake_w = mp.Pipe(duplex=False)  # the loop waits on wake_handle with the workers
        self._thread: threading.Thread | None = None
        self.stopping = False

    def start(self, body: Callable[[], None]) -> None:
        self._thread = threading.Thread(target=body, name=LOOP_THREAD_NAME, daemon=True)
        self._thread.start()

    def runs_here(self) -> bool:
        """Whether the caller may touch the state directly: it is the loop thread, or no loop has started."""
        return self._thread is None or self._thread is threading.current_thread()

    def call(self, fn: Callable, *args: Any) -> Future:
        fut: Future = Future()
        if self.stopping or self._thread is None or not self._thread.is_alive():
            fut.set_exception(EngineClosedError("the engine has been shut down"))
            return fut
        self._inbox.append((fn, args, fut))
        self.wake()
        return fut

    def run(self, fn: Callable, *args: Any, timeout: float | None = None) -> Any:
        """``fn(*args)`` in the loop thread (at once when ``runs_here``); its value or its exception, here."""
        if self.runs_here():
            return fn(*args)
        return self.call(fn, *args).result(timeout)

    def wake(self) -> None:
        try:
            self._wake_w.send_bytes(b"!")
        except OSError:
            pass

    def run_posted(self, on_worker_failure: Callable[[WorkerFailure], None] | None = None) -> None:
        """In the loop thread: run what was posted, until the inbox is empty or a call stopped the loop.
        A call's exception goes to its caller; a ``WorkerFailure`` that left the world broken (a switch that
        failed half-way, holding the requests it took) also to ``on_worker_failure``. A worker's clean refusal
        (a bad weight payload) stays the caller's alone."""
        while self.wake_handle.poll():
            self.wake_handle.recv_bytes()
        while self._inbox and not self.stopping:
            fn, args, fut = self._inbox.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # delivered to the caller
                    fut.set_exception(exc)
                    if isinstance(exc, WorkerFailure) and exc.world_broken and on_worker_failure is not None:
                        on_worker_failure(exc)

    def close(self) -> None:
        """In the loop thread, as it ends: whatever is still posted fails as the engine being shut down."""
        for _, _, fut in self._inbox:
            fut.set_exception(EngineClosedError("the engine has been shut down"))

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


def on_loop(method: F) -> F:
    """Run the decorated method of an object with a ``thread: LoopThread`` in that loop thread."""

    @functools.wraps(method)
    def in_loop(self, *args: Any, **kwargs: Any) -> Any:
        return self.thread.run(functools.partial(method, self, *args, **kwargs))

    return in_loop  # type: ignore[return-value]
