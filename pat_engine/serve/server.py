"""The pat-serve HTTP app: one FastAPI app around an already started engine, with every face's router.

``build_app(engine, config)`` (the caller owns the engine and shuts it down) makes one
``ServerState`` (``state.py``) and includes the routers: OpenAI's (``openai/routes.py``),
vLLM's tokenizer routes (``openai/tokenize_routes.py``), SGLang's native API and its weight
and memory routes (``sglang/``), and pat-serve's own (``pat_routes.py``: health, metrics,
KV, timeline, reconfigure). Every error comes back in the OpenAI error shape.

Shutdown (``ServerState.begin_drain``, run on SIGTERM): new requests get 503,
running ones may finish for ``drain_timeout_s``; then the rest are aborted
and each open stream ends with an in-band error event and ``[DONE]``.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pat_engine.core.engine import Engine
from pat_engine.errors import InvalidRequestError
from pat_engine.serve import pat_routes, profile_routes
from pat_engine.serve.async_engine import ClientDisconnected
from pat_engine.serve.errors import APIError
from pat_engine.serve.guard import RequestGuard
from pat_engine.serve.openai import routes as openai_routes
from pat_engine.serve.openai import tokenize_routes
from pat_engine.serve.sglang import routes as sglang_routes
from pat_engine.serve.sglang import weight_routes as sglang_weight_routes
from pat_engine.serve.state import DEFAULT_MAX_BODY_BYTES, ServerConfig, ServerState

__all__ = ["DEFAULT_MAX_BODY_BYTES", "ServerConfig", "ServerState", "build_app"]  # the state's names stay importable here

log = logging.getLogger(__name__)
ROUTERS = (openai_routes.router, tokenize_routes.router, pat_routes.router, sglang_routes.router,
           sglang_weight_routes.router, profile_routes.router)


def build_app(engine: Engine, config: ServerConfig) -> FastAPI:
    pat = ServerState(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await pat.aengine.shutdown()

    app = FastAPI(title="pat-serve", lifespan=lifespan)
    app.state.pat = pat  # every route's ``State`` dependency
    app.add_middleware(RequestGuard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       on_reject=pat.metrics.reject)
    _install_error_handlers(app, pat)
    for router in ROUTERS:
        app.include_router(router)
    return app


def _install_error_handlers(app: FastAPI, pat: ServerState) -> None:
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
