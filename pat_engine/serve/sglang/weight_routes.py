"""SGLang's weight-sync and memory routes on pat-serve: disk, distributed and tensor updates, the weight
version, and releasing / resuming memory for a colocated trainer.

A FastAPI router, one function per route. Answers follow SGLang: ``{"success": bool, "message": str}``,
200 or 400. A refused update (unknown name, wrong shape, a dtype that is not floating point, lists of
different lengths) is checked whole before anything is applied, so the served weights stay as they
were and the engine keeps serving.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pat_engine.core.sleep_state import MEMORY_TAGS
from pat_engine.errors import InvalidRequestError, ModelLoadError, WorkerFailure
from pat_engine.serve.sglang.body import parse_optional
from pat_engine.serve.sglang.named_tensors import parse_payload
from pat_engine.serve.sglang.protocol import (
    DestroyUpdateGroupRequest,
    InitUpdateGroupRequest,
    MemoryTagsRequest,
    UpdateFromDiskRequest,
    UpdateFromDistributedRequest,
    UpdateFromTensorRequest,
)
from pat_engine.serve.state import ServerState, State

REFUSED = (InvalidRequestError, ModelLoadError, ValueError)

router = APIRouter()


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request, pat: State) -> JSONResponse:
    req = await pat.parse(request, UpdateFromDiskRequest)
    await _abort_first(pat, req.abort_all_requests)
    return _answer(*await _run(pat.engine.update_weights_from_disk, req.model_path, req.weight_version,
                               ok=f"Succeeded to update model weights from {req.model_path}."),
                   num_paused_requests=0)


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request, pat: State) -> JSONResponse:
    req = await pat.parse(request, InitUpdateGroupRequest)
    return _answer(*await _run(pat.engine.init_weights_update_group, req.master_address, req.master_port,
                               req.rank_offset, req.world_size, req.group_name, req.backend,
                               ok="Succeeded to initialize custom process group."))


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request, pat: State) -> JSONResponse:
    req = await pat.parse(request, DestroyUpdateGroupRequest)
    existed = await asyncio.to_thread(pat.engine.destroy_weights_update_group, req.group_name)
    return _answer(existed, "Succeeded to destroy custom process group." if existed
                   else f"no weight-update group named {req.group_name!r}")


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request, pat: State) -> JSONResponse:
    req = await pat.parse(request, UpdateFromDistributedRequest)
    await _abort_first(pat, req.abort_all_requests)
    return _answer(*await _run(pat.engine.update_weights_from_distributed, req.names, req.dtypes, req.shapes,
                               req.group_name, req.weight_version, ok="Succeeded to update parameter online."))


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request, pat: State) -> JSONResponse:
    req = await pat.parse(request, UpdateFromTensorRequest)
    engine = pat.engine
    try:
        payload = await asyncio.to_thread(parse_payload, req.serialized_named_tensors, req.load_format)
        if payload.named is not None:
            named = payload.named
            engine.check_weight_update([n for n, _ in named], [tuple(t.shape) for _, t in named],
                                       [t.dtype for _, t in named])
    except InvalidRequestError as exc:
        return _answer(False, str(exc))
    await _abort_first(pat, req.abort_all_requests)
    if payload.handles is not None:  # by handle: each worker rebuilds its entry (r % len) and checks it whole
        return _answer(*await _run(engine.update_weights_from_handles, [payload.handles],
                                   weight_version=req.weight_version, ok="Succeeded to update model weights."))
    return _answer(*await _run(engine.update_weights, payload.named, weight_version=req.weight_version,
                               ok="Succeeded to update model weights."))


@router.get("/get_weight_version")
async def get_weight_version(pat: State) -> dict:
    return {"weight_version": pat.engine.weight_version}


@router.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(request: Request, pat: State) -> JSONResponse:
    """SGLang's release: every tag when none is named; released weights are discarded (a wake-up
    reloads them from disk, or the trainer pushes new ones)."""
    req = await parse_optional(pat, request, MemoryTagsRequest)
    tags = list(req.tags) if req.tags else list(MEMORY_TAGS)
    return _answer(*await _run(pat.engine.sleep, tags=tags, ok=f"released {sorted(tags)}"))


@router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(request: Request, pat: State) -> JSONResponse:
    """Restores only what is released: a retry, or a resume of an awake engine, changes nothing."""
    req = await parse_optional(pat, request, MemoryTagsRequest)
    try:
        restored = await asyncio.to_thread(pat.engine.wake_up, req.tags)
    except REFUSED as exc:
        return _answer(False, str(exc))
    except WorkerFailure as exc:
        return _answer(False, str(exc).splitlines()[0])
    return _answer(True, f"resumed {restored}" if restored else "nothing was released; nothing to do")


# ---- what the routes share ---------------------------------------------------------------------


def _answer(success: bool, message: str, **extra) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


async def _run(fn: Callable, *args, ok: str, **kwargs) -> tuple[bool, str]:
    """Run a blocking engine call; a refusal or a worker-side failure is ``(False, the reason)``."""
    try:
        await asyncio.to_thread(fn, *args, **kwargs)
    except REFUSED as exc:
        return False, str(exc)
    except WorkerFailure as exc:
        return False, str(exc).splitlines()[0]
    return True, ok


async def _abort_first(pat: ServerState, requested: bool) -> None:
    if requested:
        await asyncio.to_thread(pat.engine.abort_all, "aborted for a weight update")
