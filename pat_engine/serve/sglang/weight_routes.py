"""SGLang's weight-sync and memory routes on pat-serve: disk, distributed and tensor updates, the weight
version, and releasing / resuming memory for a colocated trainer.

Answers follow SGLang: ``{"success": bool, "message": str}``, 200 or 400. A
refused update (unknown name, wrong shape, a dtype that is not floating point,
lists of different lengths) is checked whole before anything is applied, so
the served weights stay as they were and the engine keeps serving.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
from typing import Callable

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pat_engine.core.sleep_state import MEMORY_TAGS
from pat_engine.errors import InvalidRequestError, ModelLoadError, WorkerFailure
from pat_engine.serve.sglang.body import parse_optional
from pat_engine.serve.sglang.protocol import (
    DestroyUpdateGroupRequest,
    InitUpdateGroupRequest,
    MemoryTagsRequest,
    UpdateFromDiskRequest,
    UpdateFromDistributedRequest,
    UpdateFromTensorRequest,
)
from pat_engine.serve.state import PatServer

REFUSED = (InvalidRequestError, ModelLoadError, ValueError)


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


HANDLE_FORMATS = (None, "direct")  # SGLang's load_format values that mean "load these tensors as they are"


def _is_pickle(raw: bytes) -> bool:
    return len(raw) >= 2 and raw[0] == 0x80  # pickle's PROTO opcode; a torch.save file is a zip ("PK")


def decode_entries(serialized: list[str]) -> list[bytes]:
    """The base64 entries of ``serialized_named_tensors``, decoded."""
    out = []
    for i, entry in enumerate(serialized):
        try:
            out.append(base64.b64decode(entry, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequestError(f"serialized_named_tensors[{i}] is not base64: {exc}") from None
    return out


def handle_payloads(serialized: list[str], load_format: str | None) -> list[bytes] | None:
    """SGLang's by-handle form (``MultiprocessingSerializer`` pickles of CUDA IPC / shared-memory handles,
    one entry per rank): the payloads for ``Engine.update_weights_from_handles``, which rebuilds them on
    the workers with an allowlisting unpickler. None: the entries are ``torch.save`` files (by value)."""
    raw = decode_entries(serialized)
    kinds = {_is_pickle(r) for r in raw}
    if kinds != {True}:
        if True in kinds:
            raise InvalidRequestError("serialized_named_tensors mixes handle pickles and torch.save files")
        return None
    if load_format not in HANDLE_FORMATS:
        raise InvalidRequestError(f"load_format={load_format!r} is not supported (pat-engine takes named tensors: "
                                  f"{HANDLE_FORMATS})")
    return raw


def decode_named_tensors(serialized: list[str]) -> list[tuple[str, torch.Tensor]]:
    """Each entry: base64 of ``torch.save([(name, tensor), ...])``; loaded with ``weights_only=True``
    (plain tensors only: no code runs). Handle pickles go through ``handle_payloads`` instead."""
    out = []
    for i, raw in enumerate(decode_entries(serialized)):
        try:
            obj = torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as exc:
            raise InvalidRequestError(
                f"serialized_named_tensors[{i}] is not a torch.save'd list of (name, tensor) pairs ({exc})") from None
        if not isinstance(obj, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
                for p in obj):
            raise InvalidRequestError(f"serialized_named_tensors[{i}] must hold a list of (name, tensor) pairs")
        out.extend((name, tensor) for name, tensor in obj)
    return out


def register_weight_routes(app: FastAPI, pat: PatServer) -> None:
    engine = pat.engine

    async def abort_first(requested: bool) -> None:
        if requested:
            await asyncio.to_thread(engine.abort_all, "aborted for a weight update")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        req = await pat.parse(request, UpdateFromDiskRequest)
        await abort_first(req.abort_all_requests)
        return _answer(*await _run(engine.update_weights_from_disk, req.model_path, req.weight_version,
                                   ok=f"Succeeded to update model weights from {req.model_path}."),
                       num_paused_requests=0)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        req = await pat.parse(request, InitUpdateGroupRequest)
        return _answer(*await _run(engine.init_weights_update_group, req.master_address, req.master_port,
                                   req.rank_offset, req.world_size, req.group_name, req.backend,
                                   ok="Succeeded to initialize custom process group."))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        req = await pat.parse(request, DestroyUpdateGroupRequest)
        existed = await asyncio.to_thread(engine.destroy_weights_update_group, req.group_name)
        return _answer(existed, "Succeeded to destroy custom process group." if existed
                       else f"no weight-update group named {req.group_name!r}")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        req = await pat.parse(request, UpdateFromDistributedRequest)
        await abort_first(req.abort_all_requests)
        return _answer(*await _run(engine.update_weights_from_distributed, req.names, req.dtypes, req.shapes,
                                   req.group_name, req.weight_version, ok="Succeeded to update parameter online."))

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        req = await pat.parse(request, UpdateFromTensorRequest)
        try:
            handles = handle_payloads(req.serialized_named_tensors, req.load_format)
        except InvalidRequestError as exc:
            return _answer(False, str(exc))
        if handles is not None:  # by handle: each worker rebuilds its entry (r % len) and checks it whole
            await abort_first(req.abort_all_requests)
            return _answer(*await _run(engine.update_weights_from_handles, [handles],
                                       weight_version=req.weight_version, ok="Succeeded to update model weights."))
        try:
            named = decode_named_tensors(req.serialized_named_tensors)
            engine.check_weight_update([n for n, _ in named], [tuple(t.shape) for _, t in named],
                                       [t.dtype for _, t in named])
        except InvalidRequestError as exc:
            return _answer(False, str(exc))
        await abort_first(req.abort_all_requests)
        return _answer(*await _run(engine.update_weights, named, weight_version=req.weight_version,
                                   ok="Succeeded to update model weights."))

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict:
        return {"weight_version": engine.weight_version}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request) -> JSONResponse:
        """SGLang's release: every tag when none is named; released weights are discarded (a wake-up
        reloads them from disk, or the trainer pushes new ones)."""
        req = await parse_optional(pat, request, MemoryTagsRequest)
        tags = list(req.tags) if req.tags else list(MEMORY_TAGS)
        return _answer(*await _run(engine.sleep, tags=tags, ok=f"released {sorted(tags)}"))

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request) -> JSONResponse:
        """Restores only what is released: a retry, or a resume of an awake engine, changes nothing."""
        req = await parse_optional(pat, request, MemoryTagsRequest)
        try:
            restored = await asyncio.to_thread(engine.wake_up, req.tags)
        except REFUSED as exc:
            return _answer(False, str(exc))
        except WorkerFailure as exc:
            return _answer(False, str(exc).splitlines()[0])
        return _answer(True, f"resumed {restored}" if restored else "nothing was released; nothing to do")
