"""The engine seen from asyncio: admission control, token updates as events, aborts.

``Engine.submit`` blocks on a round trip to the engine loop thread, so it runs
in a worker thread. Each request's listener (run in the engine loop thread)
only posts a wake-up onto the event loop; the consumer then reads the
request's ``snapshot()``, so an update that happened before the listener was
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
from typing import AsyncIterator, Awaitable, Callable

from pat_engine.core.engine import Engine, RequestHandle
from pat_engine.errors import EngineClosedError, InvalidRequestError
from pat_engine.sampling.params import SamplingParams
from pat_engine.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass(frozen=True)
class EngineInput:
    """What a face submits for one choice (``Engine.submit``'s prompt and params)."""

    prompt: Prompt
    params: SamplingParams
    rendered: str | None = None  # a chat's text as its template rendered it (``prompt`` holds its token ids)


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
    error: str | None = None  # why it failed, with finish_reason "error"
    text: str | None = None  # the engine's text so far, when it detokenizes (stop strings)
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    new_top_logprobs: list[list[tuple[int, float]]] | None = None  # alternatives of the new tokens


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
        def on_update(handle: RequestHandle) -> None:
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
            snap = self.handles[index].snapshot()
            start, self._sent[index] = self._sent[index], len(snap.token_ids)
            new = snap.token_ids[start:]
            lps = snap.logprobs[start:] if snap.logprobs is not None else []
            tops = snap.top_logprobs[start:] if snap.top_logprobs is not None else None
            if snap.finished:
                self._finished.add(index)
            if new or snap.finished:
                yield Update(index, new, lps, snap.token_ids, snap.finished, snap.finish_reason, snap.error,
                             snap.text, snap.stop_reason, tops)

    def abort_unfinished(self) -> None:
        """Abort what has not finished, without waiting (safe inside a cancelled task)."""
        ids = [h.request_id for i, h in enumerate(self.handles) if i not in self._finished and not h.done()]
        if ids:
            self.owner.abort_soon(ids)


class AsyncEngine:
    def __init__(self, engine: Engine, max_queued_requests: int, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self.closing = False
        self._lock = threading.Lock()
        self._active: dict[tuple[str, int], RequestHandle] = {}  # (request id, sample index) -> handle
        self._reserved = 0

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._active)

    async def submit(self, inputs: list[EngineInput], request_id: str) -> RequestGroup:
        """Queue every input (its ``n`` samples are choices ``i*n .. i*n+n-1``); refuse at once when
        stopping or over the queue limit."""
        if self.closing:
            raise ServerShuttingDown("the server is shutting down")
        choices = sum(inp.params.n for inp in inputs)
        with self._lock:
            busy = len(self._active) + self._reserved
            if busy + choices > self.max_queued_requests:
                raise ServerOverloaded(
                    f"the server is overloaded: {busy} requests in flight, at most {self.max_queued_requests} "
                    "queued; retry later")
            self._reserved += choices
        task = asyncio.ensure_future(self._submit_all(inputs, request_id))
        try:
            handles = await asyncio.shield(task)
        except asyncio.CancelledError:  # the client left mid-submission: abort whatever got queued
            task.add_done_callback(self._abort_when_submitted)
            raise
        return RequestGroup(self, handles)

    async def _submit_all(self, inputs: list[EngineInput], request_id: str) -> list[RequestHandle]:
        handles: list[RequestHandle] = []
        choices = sum(inp.params.n for inp in inputs)
        try:
            for i, inp in enumerate(inputs):
                rid = request_id if len(inputs) == 1 else f"{request_id}-{i}"
                try:
                    samples = await asyncio.to_thread(self.engine.submit_samples, inp.prompt, inp.params, rid)
                except EngineClosedError:
                    raise ServerShuttingDown("the engine has been shut down") from None
                except InvalidRequestError as exc:  # name which prompt of a multi-prompt request it was
                    raise (InvalidRequestError(f"prompt {i}: {exc}") if len(inputs) > 1 else exc) from None
                for handle in samples:
                    self._track(handle)
                handles.extend(samples)
        except BaseException:
            self.abort_soon([h.request_id for h in handles])
            raise
        finally:
            with self._lock:
                self._reserved -= choices
        return handles

    def _abort_when_submitted(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is None:
            self.abort_soon([h.request_id for h in task.result()])

    # ---- accounting, in the engine loop thread ----------------------------------------------------

    def _track(self, handle: RequestHandle) -> None:
        with self._lock:
            self._active[(handle.request_id, handle.sample_index)] = handle
        if self.metrics is not None:
            self.metrics.running.labels(self.metrics.model_name).inc()
        last = {"t": None, "n": 0}

        def on_update(h: RequestHandle) -> None:
            try:  # never let a metrics problem reach the engine loop
                n = h.num_generated
                if n > last["n"]:
                    now = time.monotonic()
                    if last["t"] is not None and self.metrics is not None:
                        self.metrics.observe_step(now - last["t"], n - last["n"])
                    last["t"], last["n"] = now, n
                if h.done():
                    self._release(h)
            except Exception:
                log.exception("request accounting failed")

        handle.add_listener(on_update)
        if handle.done():  # finished before the listener was attached
            self._release(handle)

    def _release(self, handle: RequestHandle) -> None:
        with self._lock:
            if self._active.pop((handle.request_id, handle.sample_index), None) is None:
                return
        if self.metrics is not None:
            self.metrics.running.labels(self.metrics.model_name).dec()
            self.metrics.observe_finished(handle.output(with_text=False))

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

    def _active_request_ids(self) -> list[str]:
        with self._lock:
            return sorted({rid for rid, _ in self._active})  # the samples of a request share its id

    def cut_off(self) -> None:
        """The drain timeout passed: abort what still runs (its streams end with an error event)."""
        ids = self._active_request_ids()
        if ids:
            log.warning("drain timeout: cutting off %d running requests", len(ids))
            self._abort_quietly(ids)

    def cut_off_message(self) -> str:
        return "the server shut down before this request finished (drain timeout); retry on another server"

    async def shutdown(self) -> None:
        """Refuse new requests and abort the ones in flight (their streams end with "abort")."""
        self.closing = True
        ids = self._active_request_ids()
        if ids:
            await asyncio.to_thread(self._abort_quietly, ids)
