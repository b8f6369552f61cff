"""A rank's ``torch.profiler`` session, started and stopped by the driver (``Engine.start_profile``): the
engine's own steps as they run under its scheduler, where a benchmark's in-process copy of the model misses
what the engine adds (its inputs, its worker's environment, its memory).

Each rank writes two files into the session's folder: ``<name>-rank<r>.pt.trace.json.gz``, a Chrome trace
(chrome://tracing, Perfetto, TensorBoard), and ``<name>-rank<r>.table.txt``, the operators by self time
(``key_averages``). A session with ``num_steps`` stops itself after that many steps, so a profile nobody
stops cannot grow without bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pat_engine.protocol.calls import StartProfile, StopProfile

TABLE_ROWS = 60


@dataclass
class _Session:
    call: StartProfile
    profiler: profile
    steps: int = 0


class ProfileHandlers:
    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self._session: _Session | None = None
        self._written: list[str] | None = None  # the files of a session that stopped itself, until asked for
        self._failed: str | None = None  # why such a session could not write them, until asked for

    def start_profile(self, call: StartProfile) -> None:
        if self._session is not None:
            raise RuntimeError(f"rank {self.rank} is already profiling ({self._session.call.name}): stop it first")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        profiler = profile(activities=activities, record_shapes=call.record_shapes, with_stack=call.with_stack)
        profiler.start()
        self._session, self._written, self._failed = _Session(call, profiler), None, None

    def step_launched(self) -> None:
        """One more step ran under the session (the worker calls this after each step it launches)."""
        session = self._session
        if session is None:
            return
        session.profiler.step()
        session.steps += 1
        if session.call.num_steps is not None and session.steps >= session.call.num_steps:
            try:
                self._written = self._finish()
            except Exception as exc:  # said at StopProfile: a profile's files must not fail a step
                self._failed = f"{type(exc).__name__}: {exc}"

    def stop_profile(self, call: StopProfile) -> list[str]:
        if self._session is not None:
            return self._finish()
        failed, written, self._failed, self._written = self._failed, self._written, None, None
        if failed is not None:
            raise RuntimeError(f"rank {self.rank}'s profile stopped after its steps but could not write its files: "
                               f"{failed}")
        if written is None:
            raise RuntimeError(f"rank {self.rank} has no profile to stop")
        return written

    def _finish(self) -> list[str]:
        session, self._session = self._session, None
        assert session is not None
        session.profiler.stop()
        folder = Path(session.call.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        stem = folder / f"{session.call.name}-rank{self.rank}"
        trace, table = Path(f"{stem}.pt.trace.json.gz"), Path(f"{stem}.table.txt")
        session.profiler.export_chrome_trace(str(trace))
        by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table.write_text(f"rank {self.rank}, {session.steps} steps\n"
                         + session.profiler.key_averages().table(sort_by=by, row_limit=TABLE_ROWS) + "\n")
        return [str(trace), str(table)]
