"""Reading a control route's body that may be absent (SGLang's control routes also take GET or an empty POST)."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel

from pat_engine.serve.state import ServerState

M = TypeVar("M", bound=BaseModel)


async def parse_optional(pat: ServerState, request: Request, model: type[M]) -> M:
    """The model's defaults for a GET or an empty body, else the parsed body (400 naming a bad field)."""
    if request.method == "GET" or not await request.body():
        return model()
    return await pat.parse(request, model)
