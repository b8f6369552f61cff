"""The driver-worker contract: every message that crosses the process boundary.

The driver (``pat_engine.core``) and the workers (``pat_engine.worker``) both
import this package and never each other, so the boundary is visible in the
imports: core -> protocol <- worker.

- ``steps``: the hot path (``StepCommand`` and ``AnswerHeld`` out, ``StepResult`` back).
- ``calls``: control calls, one dataclass each (in a ``Call`` envelope out, a ``Reply`` back from every
  addressed rank; the worker picks its handler by the call's type, and the call's ``ReplyRule`` folds
  the ranks' answers into one). Imported from ``pat_engine.protocol.calls``, their one home: a new
  call is written there and nowhere else in this package.
- ``switch``: a live layout change (``SwitchPlan`` out, ``SwitchReport`` back per rank).
- ``startup``: what a worker process is started with (``WorkerArgs``).
"""

from pat_engine.protocol.startup import WorkerArgs
from pat_engine.protocol.steps import (
    PENDING_TOKEN,
    AnswerHeld,
    PromptLogprobs,
    SeqStep,
    StepCommand,
    StepResult,
    TokenMask,
)
from pat_engine.protocol.switch import SeqTable, SwitchPlan, SwitchReport

__all__ = ["PENDING_TOKEN", "AnswerHeld", "PromptLogprobs", "SeqStep", "StepCommand", "SeqTable", "StepResult", "TokenMask", "SwitchPlan", "SwitchReport", "WorkerArgs"]
