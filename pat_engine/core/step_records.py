"""What ``Stepping`` keeps of a step: the one in flight per group, the optional per-step record, and who
learns from results (``StepWatcher``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pat_engine.core.request import Sequence
from pat_engine.protocol import StepCommand


class StepWatcher(Protocol):
    """What the switching learns from steps (``Switching``): its cost source and its policy's clock."""

    def prefill_done(self, tp: int, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` prompt tokens took ``seconds`` of forward under TP ``tp``."""

    def decode_step_done(self, tp: int, batch: int, context_tokens: int, seconds: float) -> None:
        """A plain decode step (no speculation) of ``batch`` requests holding ``context_tokens`` under TP
        ``tp`` took ``seconds``, dispatch to result."""

    def decode_steps_grew(self, steps: int) -> None:
        """The stage's decode-step count (the most any group has run) grew to ``steps``."""


@dataclass(frozen=True)
class StepRecord:
    """One group's step, as the profiler and predictor-accuracy benchmarks see it."""

    t: float  # timeline seconds at completion
    tp: int
    dp: int
    group: int
    is_prefill: bool
    batch_size: int  # sequences in the step
    context_tokens: int  # sum over the batch of context length after the step
    new_tokens: int  # tokens run through the model (prefill: whole prompts)
    seconds: float  # driver-side, dispatch to result (a following step, async scheduling: from the previous answer)
    forward_seconds: float  # worker-side forward + sampling on TP rank 0
    busy_groups: int  # groups with a step in flight when this one was dispatched
    head_seconds: float = 0.0  # of forward_seconds: the LM head
    sample_seconds: float = 0.0  # of forward_seconds: log-probs and the draw


@dataclass
class InFlight:
    cmd: StepCommand
    batch: list[Sequence]
    sent_at: float
    busy_groups: int
    speculative: bool = False  # a decode step dispatched while speculation was on (drafts or not)
