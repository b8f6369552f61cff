"""pat-serve's own routes: health, Prometheus metrics, the KV blocks, the layout timeline, and a live
layout change (``/pat/reconfigure``)."""

from __future__ import annotations

import asyncio
from typing import Literal, Optional

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from pat_engine.errors import LayoutError
from pat_engine.serve.errors import APIError
from pat_engine.serve.state import State

router = APIRouter()


class ReconfigureRequest(BaseModel):
    """``POST /pat/reconfigure``: change the TP degree live (dp = world / tp)."""

    model_config = ConfigDict(extra="forbid")
    tp: StrictInt = Field(ge=1)
    kv_transfer: Optional[Literal["migrate", "recompute"]] = None


@router.get("/health")
async def health(pat: State) -> dict:
    return pat.health()


@router.get("/metrics")
async def metrics(pat: State) -> Response:
    return Response(pat.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/pat/kv")
async def kv_blocks(pat: State) -> dict:
    return await asyncio.to_thread(pat.engine.kv_blocks)


@router.get("/pat/timeline")
async def timeline(pat: State) -> dict:
    return pat.engine.timeline


@router.post("/pat/reconfigure")
async def reconfigure(request: Request, pat: State) -> dict:
    req = await pat.parse(request, ReconfigureRequest)
    engine = pat.engine
    try:
        event = await asyncio.to_thread(engine.reconfigure, req.tp, req.kv_transfer)
    except LayoutError as exc:
        raise APIError(400, str(exc), param="tp") from None
    return {"success": event.ok, "layout": str(engine.layout), "kv_path": event.kv_path,
            "seconds": event.seconds, "error": event.error}
