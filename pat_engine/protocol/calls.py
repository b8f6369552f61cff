"""Calls by method name: the driver asks every addressed rank to run ``rpc_<method>``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Call:
    """Run ``method`` on every addressed worker; each one replies."""

    call_id: int
    method: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Reply:
    call_id: int
    rank: int
    ok: bool
    value: Any = None
    error: str | None = None  # formatted traceback when ok is False
    error_type: str | None = None  # the exception's class name, so the driver can re-raise its kind
