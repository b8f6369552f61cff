"""The state one pat-serve app's routes share: the engine, its asyncio bridge, metrics and config.

Every router imports it (``openai/``, ``sglang/``, ``pat_routes.py``) and none imports another's
module: ``build_app`` makes one ``ServerState`` and puts it on the app, and each route takes it as
the ``State`` dependency. It also holds what every route does the same way: parse a body (415 /
400 in the OpenAI error shape), submit (503 when full, draining or dead), collect, and health.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
import time
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from pat_engine.core.engine import Engine
from pat_engine.errors import EngineClosedError, EngineDeadError
from pat_engine.serve.async_engine import (
    AsyncEngine,
    EngineInput,
    RequestGroup,
    ServerOverloaded,
    ServerShuttingDown,
)
from pat_engine.serve.errors import APIError, validation_error
from pat_engine.serve.guard import read_body_limited
from pat_engine.serve.json_body import BadJSON, parse_json
from pat_engine.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_BODY_BYTES = 16 << 20  # 16 MiB: a full 128k-token context as JSON ids is about 1 MB


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    max_queued_requests: int = 256  # requests in flight before new ones get 503
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = None  # when set: "Authorization: Bearer <key>" on every route but /health, /metrics
    drain_timeout_s: float = 20.0  # on SIGTERM, how long running requests may go on before they are cut off
    tool_call_parser: str | None = None  # tool calls parsed out of chat answers (openai/tool_calls.py)
    reasoning_parser: str | None = None  # reasoning split off chat answers (openai/reasoning.py)


class ServerState:
    """State shared by the routes of one app: the engine bridge, metrics and config."""

    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.started = time.time()
        self.metrics = ServerMetrics(engine, config.served_model_name)
        self.aengine = AsyncEngine(engine, config.max_queued_requests, self.metrics)
        self._drain_timer: threading.Timer | None = None

    def begin_drain(self) -> None:
        """Stop taking requests now; cut the running ones off after ``drain_timeout_s`` (any thread)."""
        if self._drain_timer is not None:
            return
        self.aengine.closing = True
        log.warning("shutting down: %d requests may finish within %.0fs", self.aengine.num_active,
                    self.config.drain_timeout_s)
        self._drain_timer = threading.Timer(self.config.drain_timeout_s, self.aengine.cut_off)
        self._drain_timer.daemon = True
        self._drain_timer.start()

    def health(self) -> dict:
        """200 with the engine's state, or an APIError(503) saying why the server cannot serve now."""
        if self.aengine.closing:
            raise APIError(503, "the server is shutting down")
        h = self.engine.health()
        if h["dead"]:
            raise APIError(503, h["dead"])
        if h["restarting"] or not h["workers_alive"]:
            raise APIError(503, "workers are being restarted after a failure")
        oldest = h["oldest_step_s"]
        if oldest is not None and oldest > h["step_timeout_s"]:
            raise APIError(503, f"a step has run for {oldest:.1f}s, past step_timeout_s={h['step_timeout_s']:g}; "
                                "its workers are being replaced")
        return {"status": "ok", "layout": str(self.engine.layout), "running": self.aengine.num_active, **h}

    @property
    def model(self) -> str:
        return self.config.served_model_name

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model, self.engine.config.model):
            raise APIError(404, f"The model `{name}` does not exist.", param="model")

    async def parse(self, request: Request, model: type[M]) -> M:
        ctype = request.headers.get("content-type", "")
        if ctype.split(";")[0].strip().lower() != "application/json":
            raise APIError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}")
        raw = await read_body_limited(request, self.config.max_body_bytes)
        try:
            data = parse_json(raw)
        except BadJSON as exc:
            raise APIError(400, str(exc)) from None
        if not isinstance(data, dict):
            raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None

    async def submit(self, inputs: list[EngineInput], request_id: str) -> RequestGroup:
        try:
            return await self.aengine.submit(inputs, request_id)
        except ServerOverloaded as exc:
            self.metrics.reject("overloaded")
            raise APIError(503, str(exc), headers={"Retry-After": "1"}) from None
        except (ServerShuttingDown, EngineClosedError) as exc:
            self.metrics.reject("shutting_down")
            raise APIError(503, f"{exc}; no new requests are taken") from None
        except EngineDeadError as exc:
            self.metrics.reject("engine_dead")
            raise APIError(503, str(exc)) from None

    async def collect(self, group: RequestGroup, request: Request) -> list:
        async for _ in group.updates(disconnected=request.is_disconnected):
            pass
        outs = [h.output() for h in group.handles]
        failed = [o for o in outs if o.finish_reason == "error"]
        if failed:
            raise APIError(500, f"generation failed: {failed[0].error}")
        if self.aengine.closing and any(o.finish_reason == "abort" for o in outs):
            raise APIError(503, self.aengine.cut_off_message())
        return outs


def server_state(request: Request) -> ServerState:
    """The app's ``ServerState`` (``build_app`` sets it): what every route depends on."""
    return request.app.state.pat


State = Annotated[ServerState, Depends(server_state)]  # a route's parameter: ``pat: State``
