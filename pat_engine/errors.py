"""Exceptions raised to users. Each names the problem it reports."""

from __future__ import annotations

from typing import Any


class PatEngineError(Exception):
    """Base class of pat-engine errors."""


class ModelLoadError(PatEngineError):
    """The checkpoint cannot be served: unknown architecture, missing file, bad shape."""


class InvalidRequestError(PatEngineError, ValueError):
    """A request (prompt or sampling parameters) is malformed; nothing was queued."""


class LayoutError(PatEngineError, ValueError):
    """A (tp, dp) layout is not valid for this model and world size."""


class EngineClosedError(PatEngineError):
    """The engine was shut down."""


class EngineDeadError(PatEngineError):
    """The engine cannot serve any more (restart budget used up, or a restart failed); the message says why.

    New requests are refused at once; make a new engine (a server exits non-zero so its supervisor does)."""


class WorkerFailure(PatEngineError, RuntimeError):
    """A worker process raised, died or timed out.

    ``partial_outputs`` holds what the affected requests had generated so far,
    so nothing accepted is lost silently.
    """

    def __init__(self, message: str, *, rank: int | None = None, partial_outputs: list[Any] | None = None,
                 error_type: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.partial_outputs = partial_outputs or []
        self.error_type = error_type  # class name of the worker-side exception, when one was raised
        # the workers are in no state to go on (a switch failed half-way): the engine loop rebuilds them,
        # also when the failure reached a caller's thread first (LoopThread.run_posted)
        self.world_broken = False


def last_traceback_line(tb: str | None) -> str:
    """The line of a formatted traceback that names the exception (its last non-empty line)."""
    lines = [ln for ln in (tb or "").strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "unknown error"


def validation_message(exc: Any, prefix: str = "", unknown: str = "{loc}: unknown field", where: str = "") -> str:
    """A pydantic ``ValidationError`` as one line naming every complaint: "where: what", each place prefixed
    with ``prefix``, an unknown field worded by ``unknown`` (a format of ``loc``), each complaint led by
    ``where`` (which prompt of a batch). Every face's wording is made here; duck-typed, so this module
    imports nothing."""
    parts = []
    for e in exc.errors():
        loc = prefix + ".".join(str(p) for p in e.get("loc", ()))
        if e.get("type") == "extra_forbidden":
            parts.append(where + unknown.format(loc=loc))
            continue
        msg = e.get("msg", "invalid").removeprefix("Value error, ")
        parts.append(where + (f"{loc}: {msg}" if loc else msg))
    return "; ".join(parts)
