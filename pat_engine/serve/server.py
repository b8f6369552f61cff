"""The OpenAI-compatible HTTP app: completions, chat, models, health, metrics and the layout timeline.

``build_app(engine, config)`` makes a FastAPI app around an already started
engine (the caller owns the engine and shuts it down). Request bodies are
parsed here rather than by FastAPI so that every failure (content type,
JSON syntax, schema, size) comes back as a 4xx in the OpenAI error shape.

Shutdown (``PatServer.begin_drain``, run on SIGTERM): new requests get 503,
running ones may finish for ``drain_timeout_s``; then the rest are aborted
and each open stream ends with an in-band error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pat_engine.core.engine import Engine
from pat_engine.errors import EngineClosedError, EngineDeadError, InvalidRequestError
from pat_engine.serve.async_engine import AsyncEngine, ClientDisconnected, RequestGroup, ServerOverloaded, ServerShuttingDown
from pat_engine.serve.errors import APIError, validation_error
from pat_engine.serve.guard import RequestGuard, read_body_limited
from pat_engine.serve.json_body import BadJSON, parse_json
from pat_engine.serve.metrics import ServerMetrics
from pat_engine.serve.sglang import register_sglang_routes
from pat_engine.serve.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    random_id,
)
from pat_engine.serve.streams import chat_stream, completion_stream
from pat_engine.serve.translate import EngineInput, chat_choice, chat_input, completion_choice, completion_inputs, usage

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


class PatServer:
    """State shared by the routes of one app: the engine bridge, metrics and config."""

    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine = engine
        self.config = config
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


def build_app(engine: Engine, config: ServerConfig) -> FastAPI:
    pat = PatServer(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await pat.aengine.shutdown()

    app = FastAPI(title="pat-serve", lifespan=lifespan)
    app.state.pat = pat
    app.add_middleware(RequestGuard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       on_reject=pat.metrics.reject)
    _install_error_handlers(app, pat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await pat.parse(request, CompletionRequest)
        pat.check_model(req.model)
        rid = random_id("cmpl")
        group = await pat.submit(completion_inputs(req), rid)
        if req.stream:
            return _event_stream(completion_stream(group, req, engine.tokenizer, pat.model, rid))
        outs = await pat.collect(group, request)
        resp = CompletionResponse(id=rid, model=pat.model, usage=usage(outs),
                                  choices=[completion_choice(i, o, req, engine.tokenizer) for i, o in enumerate(outs)])
        return JSONResponse(resp.model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await pat.parse(request, ChatCompletionRequest)
        pat.check_model(req.model)
        rid = random_id("chatcmpl")
        inp = chat_input(req, engine.tokenizer, engine.max_model_len)  # refuses over-long chats first
        group = await pat.submit([inp], rid)
        if req.stream:
            return _event_stream(chat_stream(group, req, engine.tokenizer, pat.model, rid))
        outs = await pat.collect(group, request)
        resp = ChatCompletionResponse(id=rid, model=pat.model, usage=usage(outs),
                                      choices=[chat_choice(i, o, req, engine.tokenizer) for i, o in enumerate(outs)],
                                      prompt_token_ids=list(outs[0].prompt_token_ids) if req.return_token_ids else None)
        return JSONResponse(resp.model_dump())

    @app.get("/v1/models")
    async def models() -> dict:
        card = ModelCard(id=pat.model, root=engine.config.model, max_model_len=engine.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.get("/health")
    async def health() -> dict:
        return pat.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(pat.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/pat/kv")
    async def kv_blocks() -> dict:
        return await asyncio.to_thread(engine.kv_blocks)

    @app.get("/pat/timeline")
    async def timeline() -> dict:
        return engine.timeline

    register_sglang_routes(app, pat)  # SGLang's native API: /generate, control, weight sync (serve/sglang/)
    return app


def _event_stream(body: Any) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _install_error_handlers(app: FastAPI, pat: PatServer) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        if 400 <= exc.status < 500:  # 503s are counted where they are decided
            pat.metrics.reject("invalid")
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def invalid(request: Request, exc: Exception) -> Response:
        pat.metrics.reject("invalid")
        return APIError(400, str(exc)).response()

    @app.exception_handler(RequestValidationError)
    async def fastapi_validation(request: Request, exc: RequestValidationError) -> Response:
        pat.metrics.reject("invalid")
        return APIError(400, "; ".join(str(e.get("msg")) for e in exc.errors()) or "invalid request").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(ClientDisconnected)
    async def gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error in %s", request.url.path)
        return APIError(500, f"internal error: {exc!r}").response()
