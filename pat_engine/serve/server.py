"""The OpenAI-compatible HTTP app: completions, chat, models, health, metrics and the layout timeline.

``build_app(engine, config)`` makes a FastAPI app around an already started
engine (the caller owns the engine and shuts it down) and one ``PatServer``
(``state.py``), which the SGLang routes share. Request bodies are parsed by
``PatServer.parse`` rather than by FastAPI so that every failure (content type,
JSON syntax, schema, size) comes back as a 4xx in the OpenAI error shape.

Shutdown (``PatServer.begin_drain``, run on SIGTERM): new requests get 503,
running ones may finish for ``drain_timeout_s``; then the rest are aborted
and each open stream ends with an in-band error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pat_engine.core.engine import Engine
from pat_engine.errors import InvalidRequestError
from pat_engine.serve.async_engine import ClientDisconnected
from pat_engine.serve.errors import APIError
from pat_engine.serve.guard import RequestGuard
from pat_engine.serve.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    random_id,
)
from pat_engine.serve.sglang import register_sglang_routes
from pat_engine.serve.state import DEFAULT_MAX_BODY_BYTES, PatServer, ServerConfig
from pat_engine.serve.streams import chat_stream, completion_stream
from pat_engine.serve.translate import chat_choice, chat_input, completion_choice, completion_inputs, usage

__all__ = ["DEFAULT_MAX_BODY_BYTES", "PatServer", "ServerConfig", "build_app"]  # the state's names stay importable here

log = logging.getLogger(__name__)


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
