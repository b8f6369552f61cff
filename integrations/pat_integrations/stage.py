"""Generation stages: each RL rollout batch starts from the engine's base layout.

An RL framework sends one request at a time (veRL, OpenRLHF), so the adapters
decide where a stage begins: when a request (or batch) arrives at an idle
engine, which is always the case after a weight update or a wake-up.
``begin_stage`` then returns the engine to its base layout (a cheap idle
switch) and installs a fresh switch policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pat_engine import Engine, LayoutError
from pat_engine.predictor.policy import SwitchPolicy


@dataclass(frozen=True)
class StagePlan:
    """How layouts change during a stage.

    ``switch_schedule``: ``[(decode_step, tp), ...]`` applied afresh every stage;
    None leaves the engine's own policy in charge (the predictor-driven controller
    when the engine has a ``profile_table``, else a static layout).
    """

    switch_schedule: tuple[tuple[int, int], ...] | None = None
    kv_transfer: str | None = None  # "migrate", "recompute" or None (cost model)

    @classmethod
    def from_options(cls, schedule: Any = None, kv_transfer: str | None = None) -> "StagePlan":
        if schedule is None:
            return cls(None, kv_transfer)
        pairs = tuple((int(step), int(tp)) for step, tp in schedule)
        return cls(pairs, kv_transfer)

    def policy(self, engine: Engine) -> SwitchPolicy | None:
        if self.switch_schedule is None:
            return engine.policy
        try:  # refuse a bad schedule before the stage starts
            return engine.scheduled_policy(list(self.switch_schedule), self.kv_transfer)
        except LayoutError as exc:
            raise LayoutError(f"switch_schedule: {exc}") from None


@dataclass
class StageCounter:
    """What the adapters report about stages (for logs and tests)."""

    stages: int = 0
    layouts_at_start: list[str] = field(default_factory=list)


def begin_stage(engine: Engine, plan: StagePlan, counter: StageCounter | None = None) -> None:
    """Return to the base layout and reset the stage's switch policy; call with no request in flight."""
    engine.begin_stage(policy=plan.policy(engine), from_base_layout=True)
    if counter is not None:
        counter.stages += 1
        counter.layouts_at_start.append(str(engine.layout))
