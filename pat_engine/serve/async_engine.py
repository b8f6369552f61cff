"""The engine seen from asyncio: admission control, token updates as events, aborts.

``Engine.submit`` blocks on a round trip to the engine loop thread, so it runs
in a worker thread. Each request's listener (run in the engine loop thread)
only posts a wake-up onto the event loop; the consumer then reads the
request's state itself, so an update that happened before the listener was
attached is never missed.

Accounting (the running count, finished-request metrics) hangs on its own
listener, independent of whether anyone still consumes the updates: a
client that disconnects cannot leak a slot.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from pat_engine.core.engine import Engine, RequestHandle
from pat_engine.errors import EngineClosedError, InvalidRequestError
from pat_engine.serve.metrics import ServerMetrics
from pat_engine.serve.translate import EngineInput

log = logging.getLogger(__name__)


class ServerOverloaded(Exception):
    """More requests in flight than the server was configured to queue."""


class ServerShuttingDown(Exception):
    """The server is stopping (or its engine is closed) and takes no new requests."""


class ClientDisconnected(Exception):
    """The HTTP client went away; its requests were aborted."""


@dataclass(frozen=True)
class Update:
    index: int  # which choice (prompt) of the HTTP request
    new_token_ids: list[int]
    new_logprobs: list[float]  # empty unless the request asked for logprobs
    token_ids: list[int]  # everything generated so far for this choice
    finished: bool
    finish_reason: str | None


class RequestGroup:
    """The engine requests behind one HTTP request."""

    def __init__(self, owner: "AsyncEngine", handles: list[RequestHandle]):
        self.owner = owner
        self.handles = handles
        self._sent = [0] * len(handles)
        self._finished: set[int] = set()
        self._queue: asyncio.Queue[int] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for i, h in enumerate(handles):
            h.add_listener(self._listener(i, loop))
            self._queue.put_nowait(i)  # catch up with anything that happened before the listener

    def _listener(self, index: int, loop: asyncio.AbstractEventLoop) -> Callable:
        def on_update(seq: Any, new_tokens: int) -> None:
            try:
                loop.call_soon_threadsafe(self._queue.put_nowait, index)
            except RuntimeError:  # the event loop has stopped: nobody is listening any more
                pass

        return on_update

    async def updates(self, disconnected: Callable[[], Awaitable[bool]] | None = None,
                      poll_s: float = 0.5) -> AsyncIterator[Update]:
        """Yield new tokens per choice until every choice has finished.

        ``disconnected`` is polled every ``poll_s`` seconds; when it says the client
        is gone, the unfinished requests are aborted and ``ClientDisconnected`` raised.
        """
        loop = asyncio.get_running_loop()
        next_check = loop.time() + poll_s
        while len(self._finished) < len(self.handles):
            try:
                index = await asyncio.wait_for(self._queue.get(), poll_s)
            except asyncio.TimeoutError:
                index = None
            if disconnected is not None and loop.time() >= next_check:  # also while tokens keep coming
                next_check = loop.time() + poll_s
                if await disconnected():
                    self.abort_unfinished()
                    raise ClientDisconnected()
            if index is None:
                continue
            if index in self._finished:
                continue
            seq = self.handles[index].seq
            # read first: the engine sets it last when a request ends, after its final token
            reason = seq.finish_reason
            done = reason is not None
            end = len(seq.output_ids)
            if seq.params.logprobs and not done:  # the engine appends a token, then its logprob
                end = min(end, len(seq.logprobs))
            start, self._sent[index] = self._sent[index], end
            new = list(seq.output_ids[start:end])
            lps = list(seq.logprobs[start:end]) if seq.params.logprobs else []
            if done:
                self._finished.add(index)
            if new or done:
                yield Update(index, new, lps, list(seq.output_ids[:end]), done, reason)

    def abort_unfinished(self) -> None:
        """Abort what has not finished, without waiting (safe inside a cancelled task)."""
        ids = [h.request_id for i, h in enumerate(self.handles) if i not in self._finished and not h.seq.finished]
        if ids:
            self.owner.abort_soon(ids)


class AsyncEngine:
    def __init__(self, engine: Engine, max_queued_requests: int, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self.closing = False
        self._lock = threading.Lock()
        self._active: dict[str, RequestHandle] = {}
        self._reserved = 0

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._active)

    async def submit(self, inputs: list[EngineInput], request_id: str) -> RequestGroup:
        """Queue every input (one per choice); refuse at once when stopping or over the queue limit."""
        if self.closing:
            raise ServerShuttingDown("the server is shutting down")
        with self._lock:
            busy = len(self._active) + self._reserved
            if busy + len(inputs) > self.max_queued_requests:
                raise ServerOverloaded(
                    f"the server is overloaded: {busy} requests in flight, at most {self.max_queued_requests} "
                    "queued; retry later")
            self._reserved += len(inputs)
        task = asyncio.ensure_future(self._submit_all(inputs, request_id))
        try:
            handles = await asyncio.shield(task)
        except asyncio.CancelledError:  # the client left mid-submission: abort whatever got queued
            task.add_done_callback(self._abort_when_submitted)
            raise
        return RequestGroup(self, handles)

    async def _submit_all(self, inputs: list[EngineInput], request_id: str) -> list[RequestHandle]:
        handles: list[RequestHandle] = []
        try:
            for i, inp in enumerate(inputs):
                rid = request_id if len(inputs) == 1 else f"{request_id}-{i}"
                try:
                    handle = await asyncio.to_thread(self.engine.submit, inp.prompt, inp.params, rid)
                except EngineClosedError:
                    raise ServerShuttingDown("the engine has been shut down") from None
                except InvalidRequestError as exc:  # the engine numbers its single prompt 0; name the real one
                    msg = str(exc).removeprefix("prompt 0: ")
                    raise InvalidRequestError(f"prompt {i}: {msg}" if len(inputs) > 1 else msg) from None
                self._track(handle)
                handles.append(handle)
        except BaseException:
            self.abort_soon([h.request_id for h in handles])
            raise
        finally:
            with self._lock:
                self._reserved -= len(inputs)
        return handles

    def _abort_when_submitted(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is None:
            self.abort_soon([h.request_id for h in task.result()])

    # ---- accounting, in the engine loop thread ----------------------------------------------------

    def _track(self, handle: RequestHandle) -> None:
        with self._lock:
            self._active[handle.request_id] = handle
        if self.metrics is not None:
            self.metrics.running.labels(self.metrics.model_name).inc()
        last = {"t": None, "n": 0}

        def on_update(seq: Any, new_tokens: int) -> None:
            try:  # never let a metrics problem reach the engine loop
                n = len(seq.output_ids)
                if n > last["n"]:
                    now = time.monotonic()
                    if last["t"] is not None and self.metrics is not None:
                        self.metrics.observe_step(now - last["t"], n - last["n"])
                    last["t"], last["n"] = now, n
                if seq.finished:
                    self._release(handle)
            except Exception:
                log.exception("request accounting failed")

        handle.add_listener(on_update)
        if handle.seq.finish_reason is not None:  # finished before the listener was attached
            self._release(handle)

    def _release(self, handle: RequestHandle) -> None:
        with self._lock:
            if self._active.pop(handle.request_id, None) is None:
                return
        if self.metrics is not None:
            self.metrics.running.labels(self.metrics.model_name).dec()
            self.metrics.observe_finished(handle.seq.to_output(None))

    # ---- aborts and shutdown -----------------------------------------------------------------------

    def _abort_quietly(self, request_ids: list[str]) -> None:
        try:
            self.engine.abort(request_ids)
        except EngineClosedError:
            pass
        except Exception:
            log.exception("abort of %s failed", request_ids)

    def abort_soon(self, request_ids: list[str]) -> None:
        """Abort in a background thread: usable from a cancelled task or a finally block."""
        if request_ids:
            threading.Thread(target=self._abort_quietly, args=(list(request_ids),), daemon=True,
                             name="pat-serve-abort").start()

    def cut_off(self) -> None:
        """The drain timeout passed: abort what still runs (its streams end with an error event)."""
        with self._lock:
            ids = list(self._active)
        if ids:
            log.warning("drain timeout: cutting off %d running requests", len(ids))
            self._abort_quietly(ids)

    def cut_off_message(self) -> str:
        return "the server shut down before this request finished (drain timeout); retry on another server"

    async def shutdown(self) -> None:
        """Refuse new requests and abort the ones in flight (their streams end with "abort")."""
        self.closing = True
        with self._lock:
            ids = list(self._active)
        if ids:
            await asyncio.to_thread(self._abort_quietly, ids)
