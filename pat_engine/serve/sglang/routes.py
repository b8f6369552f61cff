"""SGLang's native server API on pat-serve's app: ``/generate``, aborts, pause modes, info and load.

A FastAPI router (``build_app`` includes it; the weight-sync and memory routes are
``weight_routes.py``), one function per route, each given the app's ``ServerState``
(``serve/state.py``). Bodies are parsed by ``ServerState.parse`` (415 for a wrong
content type, 400 naming a bad or unknown field); engine calls that block run in a
worker thread.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pat_engine.errors import EngineClosedError, InvalidRequestError
from pat_engine.sampling.params import SamplingParams
from pat_engine.serve.async_engine import ClientDisconnected, RequestGroup
from pat_engine.serve.errors import APIError
from pat_engine.serve.sglang.body import parse_optional
from pat_engine.serve.sglang.protocol import AbortRequest, ContinueRequest, GenerateRequest, PauseRequest
from pat_engine.serve.sglang.translate import GenerateItem, generate_items, response_object
from pat_engine.serve.sse import event_stream
from pat_engine.serve.state import ServerState, State
from pat_engine.version import __version__

HEALTH_TIMEOUT_S = 20.0

router = APIRouter()


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request, pat: State) -> Response:
    req = await pat.parse(request, GenerateRequest)
    # a null max_new_tokens tokenizes its prompt to find the room left: off the event loop
    items, batch = await asyncio.to_thread(generate_items, req, lambda prompt: _room(pat, prompt))
    group, owners = await _submit_all(pat, items)
    listed = batch or len(owners) > len(items)  # SGLang answers a list for a batch or for n > 1
    tokenizer = pat.engine.tokenizer
    if req.stream:
        return event_stream(_sse(group, owners, listed, tokenizer, request))
    async for _ in group.updates(disconnected=request.is_disconnected):
        pass
    outs = [response_object(item, h, tokenizer) for item, h in zip(owners, group.handles)]
    return JSONResponse(outs if listed else outs[0])


@router.post("/abort_request")
async def abort_request(request: Request, pat: State) -> Response:
    req = await parse_optional(pat, request, AbortRequest)
    if req.abort_all:
        await asyncio.to_thread(pat.engine.abort_all, req.abort_message or "aborted by /abort_request (abort_all)")
    elif req.rid:
        await asyncio.to_thread(pat.engine.abort, [req.rid])  # an unknown rid is no error, as in SGLang
    return Response(status_code=200)


@router.post("/pause_generation")
async def pause_generation(request: Request, pat: State) -> dict:
    req = await parse_optional(pat, request, PauseRequest)
    touched = await asyncio.to_thread(pat.engine.pause, req.mode)
    return {"message": "Generation paused successfully.", "status": "ok", "mode": req.mode, "num_requests": touched}


@router.post("/continue_generation")
async def continue_generation(request: Request, pat: State) -> dict:
    await parse_optional(pat, request, ContinueRequest)
    was_paused = pat.engine.paused
    await asyncio.to_thread(pat.engine.resume)
    message = "Generation continued successfully." if was_paused else "Generation was not paused; nothing to do."
    return {"message": message, "status": "ok"}


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(pat: State) -> Response:
    pat.engine.flush_cache()  # drops the prefix cache; always succeeds
    return Response("Cache flushed.\n", status_code=200)


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(pat: State) -> dict:
    engine = pat.engine
    arch = engine.arch
    return {"model_path": engine.config.model, "tokenizer_path": engine.config.tokenizer or engine.config.model,
            "served_model_name": pat.model, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": engine.weight_version, "architectures": [arch.architecture],
            "model_type": arch.architecture.removesuffix("ForCausalLM").lower()}


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(pat: State) -> dict:
    engine = pat.engine
    cfg, layout = engine.config, engine.layout
    status = await asyncio.to_thread(engine.cluster_status)
    return {"model_path": cfg.model, "tokenizer_path": cfg.tokenizer or cfg.model, "served_model_name": pat.model,
            "engine": "pat-engine", "version": __version__, "tp_size": layout.tp,
            "dp_size": layout.dp, "world": cfg.world, "base_tp": engine.base_layout.tp, "dtype": cfg.dtype,
            "device": cfg.device, "context_length": engine.max_model_len, "max_running_requests": cfg.max_num_seqs,
            "max_total_num_tokens": sum(g.num_blocks for g in status.groups) * status.block_size,
            "page_size": cfg.block_size, "random_seed": cfg.seed, "weight_version": engine.weight_version,
            "paused": engine.paused, "sleeping": engine.sleeping, "uptime_s": time.time() - pat.started,
            "internal_states": [{"layout": str(layout), "num_running_reqs": pat.aengine.num_active}]}


@router.get("/health_generate")
async def health_generate(pat: State) -> Response:
    """200 once one greedy token comes back; at once while requests run (they prove the engine works),
    or while paused or asleep (a probe would only wait)."""
    engine = pat.engine
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


@router.get("/get_load")
async def get_load(pat: State) -> list:
    return [dict(load, dp_rank=i) for i, load in enumerate(await _group_loads(pat))]


@router.get("/v1/loads")
async def loads(pat: State) -> dict:
    per_group = await _group_loads(pat)
    total = {k: sum(g[k] for g in per_group) for k in ("num_running_reqs", "num_waiting_reqs", "num_reqs",
                                                      "num_tokens", "max_total_num_tokens")}
    total["token_usage"] = total["num_tokens"] / max(1, total["max_total_num_tokens"])
    return {"timestamp": time.time(), "dp_rank_count": len(per_group),
            "loads": [dict(g, dp_rank=i) for i, g in enumerate(per_group)], "aggregate": total}


# ---- helpers the routes share ----------------------------------------------------------------


def _room(pat: ServerState, prompt) -> int:
    """SGLang's ``max_new_tokens: null``: whatever the context leaves after the prompt."""
    engine = pat.engine
    ids, _ = engine.request_factory.tokenize(prompt, "request")
    return max(1, engine.max_model_len - len(ids))


async def _submit_all(pat: ServerState, items: list[GenerateItem]) -> tuple[RequestGroup, list[GenerateItem]]:
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


async def _group_loads(pat: ServerState) -> list[dict]:
    status = await asyncio.to_thread(pat.engine.cluster_status)
    out = []
    for g in status.groups:
        running = sum(r.cached for r in g.requests)
        used = (g.num_blocks - g.free_blocks) * status.block_size
        cap = g.num_blocks * status.block_size
        out.append({"num_running_reqs": running, "num_waiting_reqs": len(g.requests) - running,
                    "num_reqs": len(g.requests), "num_tokens": used, "max_total_num_tokens": cap,
                    "token_usage": used / max(1, cap)})
    return out


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
