"""Checks made on every HTTP request before any route runs: API key and declared body size.

A pure ASGI middleware (not Starlette's ``BaseHTTPMiddleware``, which would
wrap streaming responses and change how client disconnects reach them).

- API key: as vLLM's ``--api-key``, clients send ``Authorization: Bearer
  <key>``; every route but ``/health`` and ``/metrics`` (probes and
  scrapers) answers 401 without it.
- Body size: a ``Content-Length`` above the limit is refused with 413
  before a byte of the body is read. Bodies sent without a length (chunked)
  are counted while they are read (``read_body_limited``).
"""

from __future__ import annotations

import hmac
from typing import Any, Awaitable, Callable

from starlette.requests import Request

from pat_engine.serve.errors import APIError

OPEN_PATHS = ("/health", "/metrics")


class RequestGuard:
    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int,
                 on_reject: Callable[[str], None] | None = None):
        self.app = app
        self._key = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self._on_reject = on_reject

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        error = self._check(scope.get("path", ""), headers)
        if error is None:
            return await self.app(scope, receive, send)
        if self._on_reject is not None:
            self._on_reject("unauthorized" if error.status == 401 else "invalid")
        await error.response()(scope, receive, send)

    def _check(self, path: str, headers: dict[bytes, bytes]) -> APIError | None:
        if self._key is not None and path not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self._key):
                return APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                                headers={"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return APIError(400, f"bad Content-Length header {length.decode(errors='replace')!r}")
            if declared > self.max_body_bytes:
                return APIError(413, f"the request body has {declared} bytes, more than the limit of "
                                     f"{self.max_body_bytes} (--max-body-bytes)")
        return None


async def read_body_limited(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as more than ``limit`` bytes have arrived."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than the limit of {limit} bytes (--max-body-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)
