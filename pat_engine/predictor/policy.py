"""The policy hook: what the coordinator tells a switch policy, and what it answers.

Every ``switch_check_interval`` decode steps the coordinator builds a
``ClusterStatus`` and asks the active policy whether to change layout. A
fixed schedule (tests, benchmarks) and the predictor-driven controller both
implement ``SwitchPolicy``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pat_engine.parallel.dp_placement import PlacementRule
from pat_engine.parallel.layout import Layout


@dataclass(frozen=True)
class RequestSnapshot:
    prompt_len: int
    generated: int
    max_new_tokens: int
    cached: bool  # has KV in its group's pool
    request_id: str = ""  # what an admission placement keys its expectations by
    seq_id: int = -1  # the sequence; a switch's placement sees requests in seq_id order

    @property
    def context_len(self) -> int:
        return self.prompt_len + self.generated

    @classmethod
    def of(cls, seq) -> "RequestSnapshot":
        """The snapshot of an unfinished ``core.request.Sequence``."""
        return cls(len(seq.prompt_ids), len(seq.output_ids), seq.params.max_new_tokens, seq.num_cached > 0,
                   seq.request_id, seq.seq_id)


@dataclass(frozen=True)
class GroupSnapshot:
    group: int
    requests: tuple[RequestSnapshot, ...]
    free_blocks: int
    num_blocks: int
    decode_step_s: float | None  # recent mean decode step latency


@dataclass(frozen=True)
class SpeculationStatus:
    """Speculative decoding as measured so far this engine (docs/speculative.md): it runs while the
    engine has at most ``max_active`` unfinished requests. The step figures are means over recent
    verify steps (None before the first)."""

    max_active: int
    tokens_per_step: float | None = None  # tokens a speculating request gains per verify step (accepted + 1)
    step_s: float | None = None  # a verify step's seconds, dispatch to result
    batch: float | None = None  # requests per verify step
    context_tokens: float | None = None  # total context of a verify step's requests
    tp: int = 1  # the TP degree they were measured at

    @property
    def measured(self) -> bool:
        return self.tokens_per_step is not None and self.step_s is not None


@dataclass(frozen=True)
class ClusterStatus:
    time: float
    layout: Layout
    groups: tuple[GroupSnapshot, ...]
    stage_decode_step: int  # decode steps of the busiest group since the stage began
    block_size: int
    # the coordinator's admission placement: a switch re-places requests with its ``rebalance`` when it
    # has one, so a policy pricing a switch must place with it too (``parallel.dp_placement.switch_placement``)
    placement: PlacementRule | None = None
    speculation: SpeculationStatus | None = None  # None: speculative decoding is off

    @property
    def requests(self) -> list[RequestSnapshot]:
        return [r for g in self.groups for r in g.requests]

    @property
    def num_active(self) -> int:
        return sum(len(g.requests) for g in self.groups)


@dataclass(frozen=True)
class SwitchDecision:
    tp: int
    reason: str
    kv_path: str | None = None  # force "migrate" or "recompute"; None: cost model
    details: dict = field(default_factory=dict)  # e.g. predicted remaining times


class SwitchPolicy(Protocol):
    """``decide`` is called every ``interval`` decode steps (None: the engine's ``switch_check_interval``).

    A policy whose ``decide`` costs host time may set ``overlaps_steps = True``: on a GPU it is then called
    once the next steps have been sent, so its arithmetic runs while the device computes them, and a switch
    it asks for lands one step later (core/switching.py)."""

    interval: int | None

    def decide(self, status: ClusterStatus) -> SwitchDecision | None: ...


class StaticLayout:
    """Never switch: for runs that must stay static on an engine that has a controller attached."""

    def decide(self, status: ClusterStatus) -> SwitchDecision | None:
        return None


class ScheduledSwitches:
    """Switch to ``tp`` once the stage reaches each given decode step (deterministic)."""

    interval = 1  # look at every decode step so switches land exactly on schedule

    def __init__(self, schedule: list[tuple[int, int]], kv_path: str | None = None):
        self.schedule = sorted((int(s), int(tp)) for s, tp in schedule)
        self.kv_path = kv_path
        self._next = 0

    def decide(self, status: ClusterStatus) -> SwitchDecision | None:
        while self._next < len(self.schedule) and status.stage_decode_step >= self.schedule[self._next][0]:
            step, tp = self.schedule[self._next]
            self._next += 1
            if status.num_active == 0:
                continue
            if tp != status.layout.tp:
                return SwitchDecision(tp, f"schedule: decode step {step}", self.kv_path)
        return None
