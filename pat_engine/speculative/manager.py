"""``Speculation``: the driver's side of speculative decoding, for every DP group.

It decides which requests of a decode step get a draft and how long (``drafts``), learns
from each verify result (``observe``) and from every decode step's cost (``observe_cost``),
and reports what it measured to the switch policy (``status``). Speculation runs while the
engine has at most ``max_active`` unfinished requests: the same count the layout controller
sees, so the tail that makes the controller move to a higher TP is also where speculation
turns on, and the controller prices the remaining steps with the measured tokens per step
(``LatencyPredictor.set_speculation``).

Draft lengths (``adaptive``, speculative/budget.py): each request's proposal is cut where one more
token would lower the step's expected tokens per second, given the request's measured
acceptance and the measured cost per token of a step. A request is not drafted for while
tokens are suppressed (before ``min_new_tokens``: the verify step samples a row's positions
with one suppression set), nor past its length caps (``k + 1`` tokens can come back).
"""

from __future__ import annotations

from dataclasses import dataclass

from pat_engine.core.request import Sequence
from pat_engine.predictor.policy import SpeculationStatus
from pat_engine.protocol import SeqStep
from pat_engine.speculative.budget import AcceptanceEstimate, StepCostFit, allocate
from pat_engine.speculative.config import SpeculativeConfig
from pat_engine.speculative.proposer import DraftProposer, NgramProposer

_ALPHA = 0.2  # EMA weight of the newest step in the status figures


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new


@dataclass
class SpeculationStats:
    """Totals since the engine started (benchmarks and /metrics read them)."""

    verify_steps: int = 0
    drafted_rows: int = 0  # rows of verify steps that carried a draft
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    produced_tokens: int = 0  # by drafted rows: accepted + one each

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.produced_tokens / self.drafted_rows if self.drafted_rows else 1.0

    def to_dict(self) -> dict:
        """What ``Engine.speculation_stats`` reports."""
        return {"verify_steps": self.verify_steps, "drafted_rows": self.drafted_rows,
                "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
                "acceptance_rate": self.acceptance_rate, "tokens_per_step": self.tokens_per_step}


class Speculation:
    def __init__(self, config: SpeculativeConfig, proposer: DraftProposer | None = None):
        self.config = config
        self.proposer: DraftProposer = proposer or NgramProposer(config)
        self.stats = SpeculationStats()
        self.acceptance = AcceptanceEstimate()
        self.cost = StepCostFit()
        self._cost_tp: int | None = None  # the TP the cost fit was measured at
        self._tokens_per_step: float | None = None
        self._step_s: float | None = None
        self._batch: float | None = None
        self._context: float | None = None
        self._tp = 1

    def use(self, proposer: DraftProposer, tracked: list[Sequence] = ()) -> None:
        """Draft with ``proposer`` from now on; ``tracked``: the unfinished requests it must know."""
        self.proposer = proposer
        self.track(list(tracked))

    # ---- requests coming and going ------------------------------------------------------------------

    def track(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.proposer.track(seq)

    def release(self, seq: Sequence) -> None:
        self.acceptance.forget(seq.seq_id)
        self.proposer.release(seq)

    def remember(self, prompt: list[int], response: list[int]) -> None:
        """An earlier response to ``prompt`` (for proposers that keep a response store)."""
        remember = getattr(self.proposer, "remember", None)
        if remember is not None:
            remember(prompt, response)

    # ---- one step --------------------------------------------------------------------------------

    def active(self, num_unfinished: int) -> bool:
        return self.config.enabled and num_unfinished <= self.config.max_active

    def drafts(self, batch: list[Sequence]) -> dict[int, list[int]]:
        """seq_id -> draft, for the requests of a decode step that get one."""
        proposals: list[list[int]] = []
        for seq in batch:
            room = min(seq.params.max_new_tokens - len(seq.output_ids), seq.max_len - seq.length) - 1
            k = min(self.config.max_draft, room)
            drafts_allowed = k >= 1 and not seq.suppressed_now() and seq.grammar is None  # a grammar follows each token
            proposals.append(self.proposer.propose(seq, k) if drafts_allowed else [])
        cost = self.cost.params() if self.config.adaptive else None
        lengths = allocate([len(d) for d in proposals], [self.acceptance.p(s.seq_id) for s in batch], cost, len(batch))
        return {s.seq_id: d[:n] for s, d, n in zip(batch, proposals, lengths) if n > 0}

    def observe(self, seq: Sequence, drafted: int, produced: int) -> None:
        """A verify result: ``seq`` had ``drafted`` tokens drafted and gained ``produced`` (accepted + 1)."""
        if drafted == 0:
            return
        accepted = produced - 1
        self.stats.drafted_rows += 1
        self.stats.drafted_tokens += drafted
        self.stats.accepted_tokens += accepted
        self.stats.produced_tokens += produced
        self.acceptance.add(seq.seq_id, drafted, accepted)

    def observe_cost(self, tp: int, tokens: int, seconds: float) -> None:
        """Any decode step (speculating or not): ``tokens`` run in ``seconds``, for the draft budget."""
        if tp != self._cost_tp:  # another layout: other costs
            self.cost.reset()
            self._cost_tp = tp
        self.cost.add(tokens, seconds)

    def observe_step(self, tp: int, batch: int, context_tokens: int, seconds: float, produced: int,
                     verify: bool) -> None:
        """A decode step run while speculation was on (``verify``: some row had a draft): its driver-side
        seconds and the tokens its ``batch`` requests gained, for the policy's remaining-time estimate."""
        self.stats.verify_steps += int(verify)
        self.acceptance.step()
        self._tokens_per_step = _ema(self._tokens_per_step, produced / batch)
        self._step_s = _ema(self._step_s, seconds)
        self._batch = _ema(self._batch, batch)
        self._context = _ema(self._context, context_tokens)
        self._tp = tp

    def observe_decode(self, tp: int, batch: list[Sequence], steps: list[SeqStep], counts: list[int], seconds: float,
                       speculating: bool, verify: bool) -> None:
        """A decode step's result: its cost, always; when it was dispatched while speculating, each
        drafted request's acceptance and the step's speed, for the draft budget and the policy."""
        self.observe_cost(tp, sum(len(s.token_ids) for s in steps), seconds)
        if not speculating:
            return
        for seq, step, n in zip(batch, steps, counts):
            self.observe(seq, len(step.token_ids) - 1, n)
        self.observe_step(tp, len(batch), sum(s.start_pos + 1 for s in steps), seconds, sum(counts), verify)

    def status(self) -> SpeculationStatus | None:
        if not self.config.enabled:
            return None
        return SpeculationStatus(self.config.max_active, self._tokens_per_step, self._step_s, self._batch,
                                 self._context, self._tp)
