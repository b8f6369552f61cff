"""The driver's side of a ``torch.profiler`` session over every worker (``Engine.start_profile``): one session
at a time, its folder and name chosen here, each rank's files written by the rank
(worker/profile_handlers.py)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from pat_engine.errors import InvalidRequestError
from pat_engine.protocol.calls import StartProfile, StopProfile, WorkerCall

PROFILER_DIR_ENV = "PAT_TORCH_PROFILER_DIR"  # vLLM's VLLM_TORCH_PROFILER_DIR, SGLang's SGLANG_TORCH_PROFILER_DIR


class Profiling:
    def __init__(self, ask_workers: Callable[[WorkerCall], Any]):
        self._ask = ask_workers
        self.running: StartProfile | None = None
        self._sessions = 0

    def start(self, output_dir: str | None, num_steps: int | None, record_shapes: bool, with_stack: bool) -> str:
        if self.running is not None:
            raise InvalidRequestError(f"a profile is already running (into {self.running.output_dir}): "
                                      "stop_profile first")
        if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int)
                                      or num_steps < 1):
            raise InvalidRequestError(f"num_steps must be a positive integer or None, got {num_steps!r}")
        folder = output_dir or os.environ.get(PROFILER_DIR_ENV) or tempfile.mkdtemp(prefix="pat-profile-")
        os.makedirs(folder, exist_ok=True)
        self._sessions += 1  # with the driver's pid: no two sessions in one folder share a name
        name = f"pat-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self._sessions}"
        call = StartProfile(os.path.abspath(folder), name, num_steps, record_shapes, with_stack)
        try:
            self._ask(call)
        except Exception:  # a rank refused: stop those that started, so the next start finds none running
            with contextlib.suppress(Exception):
                self._ask(StopProfile())
            raise
        self.running = call
        return call.output_dir

    def stop(self) -> list[str]:
        if self.running is None:
            raise InvalidRequestError("no profile is running: start_profile first")
        self.running = None
        return [path for rank_files in self._ask(StopProfile()) for path in rank_files]
