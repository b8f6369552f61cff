"""Fault injection for tests and ``bench/faults.py``: a worker that can be told to fail, outside the engine.

An engine started with ``worker_class=FAULT_WORKER`` runs ``FaultInjectingWorker`` on every rank (and
again after every restart). ``inject_fault(engine, ranks, where, how)`` arms the next pass of those
ranks through ``where`` to raise, hang or exit: "step" (a step), "switch_start" (a switch, before its
first barrier) or "reshard" (a switch, after the first reshard unit moved); ``after`` lets that many
passes through first (the 11th step of a batch, not its prefill). The engine's own worker
has no fault points: its step path is the same call with nothing to check.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from pat_engine import Engine
from pat_engine.protocol import SwitchPlan, SwitchReport, WorkerArgs
from pat_engine.protocol.calls import WorkerCall
from pat_engine.worker.switch_executor import SwitchExecutor
from pat_engine.worker.worker import Worker

FAULT_WORKER = "fault_injection:FaultInjectingWorker"  # EngineConfig.worker_class
FAULT_KINDS = ("raise", "hang", "exit")
FAULT_POINTS = ("step", "switch_start", "reshard")


@dataclass(frozen=True)
class InjectFault(WorkerCall[None]):
    """The next pass of the addressed ranks through ``where`` raises, hangs or exits (``how``)."""

    where: str
    how: str = "raise"
    after: int = 0  # passes through ``where`` let by first


class FaultPoints:
    """What is armed on one rank: where -> (how, passes to let by); each fires once."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._armed: dict[str, tuple[str, int]] = {}

    def arm(self, where: str, how: str, after: int = 0) -> None:
        if where not in FAULT_POINTS or how not in FAULT_KINDS or after < 0:
            raise ValueError(f"faults are one of {FAULT_KINDS} at one of {FAULT_POINTS} after >= 0 passes, "
                             f"got {how!r} at {where!r} after {after}")
        self._armed[where] = (how, after)

    def check(self, where: str) -> None:
        how, after = self._armed.pop(where, (None, 0))
        if after > 0:
            self._armed[where] = (how, after - 1)
            return
        if how == "exit":
            os._exit(17)
        if how == "hang":
            time.sleep(3600)
        if how == "raise":
            raise RuntimeError(f"injected fault at {where} on rank {self.rank}")


class FaultInjectingSwitch(SwitchExecutor):
    def __init__(self, faults: FaultPoints, switcher: SwitchExecutor) -> None:
        super().__init__(switcher.rank, switcher.cpu_world, switcher.groups)
        self.faults = faults

    def run(self, plan: SwitchPlan, executor) -> SwitchReport:
        self.faults.check("switch_start")
        return super().run(plan, executor)

    def reshard_unit(self, index: int, *args) -> tuple[int, int, int]:
        if index == 1:  # the embedding has moved: the model is part old layout, part new
            self.faults.check("reshard")
        return super().reshard_unit(index, *args)


class FaultInjectingWorker(Worker):
    def __init__(self, args: WorkerArgs) -> None:
        super().__init__(args)
        self.faults = FaultPoints(args.rank)
        self.layout_calls.switcher = FaultInjectingSwitch(self.faults, self.layout_calls.switcher)

    def inject_fault(self, call: InjectFault) -> None:
        self.faults.arm(call.where, call.how, call.after)

    def step(self, cmd):
        self.faults.check("step")
        return super().step(cmd)


def inject_fault(engine: Engine, ranks: list[int] | None, where: str, how: str = "raise", after: int = 0) -> None:
    """Arm ``where`` on ``ranks`` (None: every rank) of an engine started with ``worker_class=FAULT_WORKER``,
    to fire after ``after`` passes."""
    if engine.config.worker_class != FAULT_WORKER:
        raise ValueError(f"start the engine with worker_class={FAULT_WORKER!r} to inject faults")
    stepping = engine.coordinator.stepping
    engine.coordinator.thread.run(lambda: stepping.pool.ask(InjectFault(where, how, after), ranks))
