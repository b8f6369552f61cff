"""SGLang's native server API on pat-serve's app: ``/generate``, aborts, pause modes, info and load.

``register_sglang_routes(app, pat)`` adds the routes to the app ``build_app``
made (weights and memory routes live in ``weight_routes.py``), sharing its
``PatServer`` (``serve/state.py``). Bodies are parsed by ``PatServer.parse``
(415 for a wrong content type, 400 naming a bad or unknown field); engine
calls that block run in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pat_engine.errors import EngineClosedError, InvalidRequestError, LayoutError
from pat_engine.sampling.params import SamplingParams
from pat_engine.serve.async_engine import ClientDisconnected, RequestGroup
from pat_engine.serve.errors import APIError
from pat_engine.serve.sglang.body import parse_optional
from pat_engine.serve.sglang.protocol import (
    AbortRequest,
    ContinueRequest,
    GenerateRequest,
    PauseRequest,
    ReconfigureRequest,
)
from pat_engine.serve.sglang.translate import GenerateItem, generate_items, response_object
from pat_engine.serve.sglang.weight_routes import register_weight_routes
from pat_engine.serve.state import PatServer
from pat_engine.version import __version__

HEALTH_TIMEOUT_S = 20.0


def register_sglang_routes(app: FastAPI, pat: PatServer) -> None:
    engine = pat.engine
    started = time.time()

    async def submit_all(items: list[GenerateItem]) -> tuple[RequestGroup, list[GenerateItem]]:
        """One handle per sample (``n`` per prompt, prompt-major), and the item each one answers."""
        handles, owners = [], []
        try:
            for item in items:
                group = await pat.submit([item.input], item.rid)
                handles.extend(group.handles)
                owners.extend([item] * len(group.handles))
        except BaseException:
            pat.aengine.abort_soon([h.request_id for h in handles])
            raise
        return RequestGroup(pat.aengine, handles), owners

    def room(prompt) -> int:
        """SGLang's ``max_new_tokens: null``: whatever the context leaves after the prompt."""
        ids, _ = engine.request_factory.tokenize(prompt, "request")
        return max(1, engine.max_model_len - len(ids))

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        req = await pat.parse(request, GenerateRequest)
        items, batch = generate_items(req, room)
        group, owners = await submit_all(items)
        listed = batch or len(owners) > len(items)  # SGLang answers a list for a batch or for n > 1
        if req.stream:
            return StreamingResponse(_sse(group, owners, listed, engine.tokenizer, request),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        async for _ in group.updates(disconnected=request.is_disconnected):
            pass
        outs = [response_object(item, h, engine.tokenizer) for item, h in zip(owners, group.handles)]
        return JSONResponse(outs if listed else outs[0])

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        req = await parse_optional(pat, request, AbortRequest)
        if req.abort_all:
            await asyncio.to_thread(engine.abort_all, req.abort_message or "aborted by /abort_request (abort_all)")
        elif req.rid:
            await asyncio.to_thread(engine.abort, [req.rid])  # an unknown rid is no error, as in SGLang
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict:
        req = await parse_optional(pat, request, PauseRequest)
        touched = await asyncio.to_thread(engine.pause, req.mode)
        return {"message": "Generation paused successfully.", "status": "ok", "mode": req.mode,
                "num_requests": touched}

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> dict:
        await parse_optional(pat, request, ContinueRequest)
        was_paused = engine.paused
        await asyncio.to_thread(engine.resume)
        message = "Generation continued successfully." if was_paused else "Generation was not paused; nothing to do."
        return {"message": message, "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        engine.flush_cache()  # drops the prefix cache; always succeeds
        return Response("Cache flushed.\n", status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict:
        arch = engine.arch
        return {"model_path": engine.config.model, "tokenizer_path": engine.config.tokenizer or engine.config.model,
                "served_model_name": pat.model, "is_generation": True, "preferred_sampling_params": None,
                "weight_version": engine.weight_version, "architectures": [arch.architecture],
                "model_type": arch.architecture.removesuffix("ForCausalLM").lower()}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> dict:
        cfg, layout = engine.config, engine.layout
        status = await asyncio.to_thread(engine.cluster_status)
        return {"model_path": cfg.model, "tokenizer_path": cfg.tokenizer or cfg.model, "served_model_name": pat.model,
                "engine": "pat-engine", "version": __version__, "tp_size": layout.tp,
                "dp_size": layout.dp, "world": cfg.world, "base_tp": engine.base_layout.tp, "dtype": cfg.dtype,
                "device": cfg.device, "context_length": engine.max_model_len, "max_running_requests": cfg.max_num_seqs,
                "max_total_num_tokens": sum(g.num_blocks for g in status.groups) * status.block_size,
                "page_size": cfg.block_size, "random_seed": cfg.seed, "weight_version": engine.weight_version,
                "paused": engine.paused, "sleeping": engine.sleeping, "uptime_s": time.time() - started,
                "internal_states": [{"layout": str(layout), "num_running_reqs": pat.aengine.num_active}]}

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """200 once one greedy token comes back; at once while requests run (they prove the engine works),
        or while paused or asleep (a probe would only wait)."""
        if pat.aengine.closing:
            return Response(status_code=503)
        if pat.aengine.num_active or engine.paused or engine.sleeping:
            return Response(status_code=200)
        try:
            handle = await asyncio.to_thread(engine.submit, [0], SamplingParams(max_new_tokens=1))
        except (InvalidRequestError, EngineClosedError):
            return Response(status_code=503)
        done = await asyncio.to_thread(handle.wait, HEALTH_TIMEOUT_S)
        ok = done and handle.output(with_text=False).finish_reason in ("stop", "length")
        if not done:
            pat.aengine.abort_soon([handle.request_id])
        return Response(status_code=200 if ok else 503)

    @app.get("/get_load")
    async def get_load() -> list:
        return [dict(load, dp_rank=i) for i, load in enumerate(await _group_loads())]

    @app.get("/v1/loads")
    async def loads() -> dict:
        per_group = await _group_loads()
        total = {k: sum(g[k] for g in per_group) for k in ("num_running_reqs", "num_waiting_reqs", "num_reqs",
                                                          "num_tokens", "max_total_num_tokens")}
        total["token_usage"] = total["num_tokens"] / max(1, total["max_total_num_tokens"])
        return {"timestamp": time.time(), "dp_rank_count": len(per_group),
                "loads": [dict(g, dp_rank=i) for i, g in enumerate(per_group)], "aggregate": total}

    async def _group_loads() -> list[dict]:
        status = await asyncio.to_thread(engine.cluster_status)
        out = []
        for g in status.groups:
            running = sum(r.cached for r in g.requests)
            used = (g.num_blocks - g.free_blocks) * status.block_size
            cap = g.num_blocks * status.block_size
            out.append({"num_running_reqs": running, "num_waiting_reqs": len(g.requests) - running,
                        "num_reqs": len(g.requests), "num_tokens": used, "max_total_num_tokens": cap,
                        "token_usage": used / max(1, cap)})
        return out

    @app.post("/pat/reconfigure")
    async def reconfigure(request: Request) -> dict:
        req = await pat.parse(request, ReconfigureRequest)
        try:
            event = await asyncio.to_thread(engine.reconfigure, req.tp, req.kv_transfer)
        except LayoutError as exc:
            raise APIError(400, str(exc), param="tp") from None
        return {"success": event.ok, "layout": str(engine.layout), "kv_path": event.kv_path,
                "seconds": event.seconds, "error": event.error}

    register_weight_routes(app, pat)


async def _sse(group: RequestGroup, items: list[GenerateItem], batch: bool, tokenizer,
               request: Request) -> AsyncIterator[str]:
    """SGLang's stream: one cumulative response object per update (``index`` in a batch), then ``[DONE]``."""
    try:
        async for update in group.updates(disconnected=request.is_disconnected):
            i = update.index
            obj = response_object(items[i], group.handles[i], tokenizer)
            if batch:
                obj["index"] = i
            yield f"data: {json.dumps(obj)}\n\n"
    except ClientDisconnected:
        return
    except Exception as exc:  # the status line is already sent: report in band, as SGLang does
        yield APIError(500, f"generation failed: {exc}").sse()
    yield "data: [DONE]\n\n"
