"""``/start_profile`` and ``/stop_profile``, as vLLM and SGLang serve them: ``torch.profiler`` over every worker
(``Engine.start_profile``). The files go to ``$PAT_TORCH_PROFILER_DIR`` on the server, which a request cannot
choose; without it profiling is off, as in vLLM. A profile stops itself after ``num_steps`` steps of each rank
(at most ``MAX_HTTP_STEPS``), so a request cannot make the profiler record without bound."""

from __future__ import annotations

import asyncio
import os
from typing import Optional

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from pat_engine.core.profiling import PROFILER_DIR_ENV
from pat_engine.serve.errors import APIError
from pat_engine.serve.state import State

router = APIRouter()

DEFAULT_HTTP_STEPS = 200
MAX_HTTP_STEPS = 5000


class StartProfileRequest(BaseModel):
    """The body of ``POST /start_profile`` (optional; SGLang's names)."""

    model_config = ConfigDict(extra="forbid")
    num_steps: Optional[StrictInt] = Field(DEFAULT_HTTP_STEPS, ge=1, le=MAX_HTTP_STEPS)
    record_shapes: StrictBool = False
    with_stack: StrictBool = False


@router.post("/start_profile")
async def start_profile(request: Request, pat: State) -> dict:
    folder = os.environ.get(PROFILER_DIR_ENV)
    if not folder:
        raise APIError(404, f"profiling is off: start the server with {PROFILER_DIR_ENV} set to the folder for "
                            "the profiles")
    req = await pat.parse(request, StartProfileRequest) if await request.body() else StartProfileRequest()
    steps = DEFAULT_HTTP_STEPS if req.num_steps is None else req.num_steps
    output_dir = await asyncio.to_thread(pat.engine.start_profile, folder, num_steps=steps,
                                         record_shapes=req.record_shapes, with_stack=req.with_stack)
    return {"message": f"Start profiling ({steps} steps at most).", "output_dir": output_dir}


@router.post("/stop_profile")
async def stop_profile(pat: State) -> dict:
    files = await asyncio.to_thread(pat.engine.stop_profile)
    return {"message": "Stop profiling.", "files": files}
