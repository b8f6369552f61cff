"""RequestHandle: what a caller holds for one submitted request.

The engine loop thread appends tokens to the request's ``Sequence``; any
other thread (a waiting caller, the HTTP server, a stream) reads the request
only through ``snapshot()``. After every update the loop publishes, under the
handle's lock, how many tokens (and logprobs) are complete and whether the
request finished; a snapshot copies exactly that much. Generated tokens are
only ever appended, so the published prefix never changes under a reader.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

from pat_engine.core.request import Sequence
from pat_engine.outputs import RequestOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestProgress:
    """A consistent view of one request at one moment."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far
    logprobs: list[float] | None  # one per generated token, when the request asked for them
    finish_reason: str | None  # None while it runs
    error: str | None
    text: str | None = None  # the engine's response text when it detokenizes (stop strings), partial
    # stop-string matches held back; None otherwise (readers decode ``token_ids`` themselves)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per generated token, when asked
    weight_versions: list[tuple[str, int, int]] = field(default_factory=list)  # (version, start, end) over
    # token_ids: which weights made them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class _Published:
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    text: str | None = None
    stop_reason: int | str | None = None


class RequestHandle:
    """A submitted request: wait for it, read a snapshot of it, or watch it grow (streaming)."""

    def __init__(self, seq: Sequence, decode: Callable[[list[int]], str | None]):
        self._seq = seq
        self._decode = decode
        self._done = threading.Event()
        self._cond = threading.Condition()
        self._published = _Published()
        self._listeners: list[Callable[[RequestHandle], None]] = []
        seq.on_update = self._on_update

    @property
    def request_id(self) -> str:
        return self._seq.request_id

    @property
    def prompt(self) -> str | None:
        """The prompt's text, when it was sent as text."""
        return self._seq.prompt

    @property
    def dp_group(self) -> int:
        """The DP group serving the request now (it can change at a layout switch)."""
        return self._seq.group

    @property
    def sample_index(self) -> int:
        return self._seq.sample_index

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self._seq.prompt_ids)

    def add_listener(self, fn: Callable[["RequestHandle"], None]) -> None:
        """``fn(handle)`` runs in the engine loop thread after every update (keep it short)."""
        self._listeners.append(fn)

    def _on_update(self, seq: Sequence, new_tokens: int) -> None:
        with self._cond:  # publish first: listeners and waiters read what is published
            self._published = _Published(len(seq.output_ids), seq.finish_reason, seq.error, seq.visible_text(),
                                         seq.stop_reason)
            self._cond.notify_all()
        if seq.finished:  # before the listeners: they may ask done()
            self._done.set()
        for fn in self._listeners:
            try:
                fn(self)
            except Exception:  # a caller's bug must not reach the engine loop (it would restart the workers)
                log.exception("a listener of request %s raised; the request goes on", seq.request_id)

    @property
    def num_generated(self) -> int:
        with self._cond:
            return self._published.num_tokens

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def snapshot(self) -> RequestProgress:
        with self._cond:
            pub = self._published
        seq = self._seq
        n = pub.num_tokens
        logprobs = list(seq.logprobs[:n]) if seq.params.logprobs else None
        tops = list(seq.top_logprobs[:n]) if seq.params.logprobs and seq.params.top_logprobs else None
        return RequestProgress(seq.request_id, list(seq.prompt_ids), list(seq.output_ids[:n]), logprobs,
                               pub.finish_reason, pub.error, pub.text, pub.stop_reason, tops,
                               seq.weight_version_spans(n))

    def output(self, with_text: bool = True) -> RequestOutput:
        """The request as it stands (final once ``done()``); ``with_text=False`` skips detokenizing."""
        progress = self.snapshot()
        return self._seq.to_output(self._decode if with_text else None, progress.token_ids,
                                   progress.finish_reason, progress.error, progress.text if with_text else None)

    def stream(self, poll_s: float = 0.5) -> Iterator[list[int]]:
        """Yield lists of newly generated token ids until the request finishes."""
        sent = 0
        while True:
            with self._cond:
                if self._published.num_tokens == sent and self._published.finish_reason is None:
                    self._cond.wait(poll_s)
            progress = self.snapshot()
            ids = progress.token_ids[sent:]
            if ids:
                sent += len(ids)
                yield ids
            if progress.finished and sent >= len(progress.token_ids):
                return
