"""RolloutScheduler: which prompts, how many responses, which round kind, each RL step (pure logic).

Ties the policies together: SAGC picks the group size G (responses per step N fixed, so
P0 = N / G prompts), tail batching picks a short or a long round, and the length history
learns per-prompt lengths for the long round's layout. The engine-facing
``RolloutRunner`` and the multi-step simulator both drive it the same way:
``plan = next_round()``, run it feeding a ``RoundTracker``, ``finish_round(...)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pat_engine.rollout.config import RolloutConfig
from pat_engine.rollout.group_sizing import GroupSizeController, straggler_ratio
from pat_engine.rollout.length_history import LengthHistory
from pat_engine.rollout.tail_batching import Partial, PromptEntry, RoundPlan, RoundTracker, TailBatcher


@dataclass(frozen=True)
class RoundSummary:
    step: int
    kind: str
    group_size: int
    prompts_launched: int
    responses_launched: int
    prompts_returned: int
    responses_returned: int
    prompts_deferred: int
    stragglers: int  # returned groups whose max/median length exceeds the threshold
    queue_after: int  # prompts waiting for a long round

    @property
    def straggler_rate(self) -> float:
        return self.stragglers / self.prompts_returned if self.prompts_returned else 0.0

    @property
    def responses_discarded(self) -> int:
        return self.responses_launched - self.responses_returned


class RolloutScheduler:
    def __init__(self, config: RolloutConfig, draw: Callable[[int], list[PromptEntry]], default_length: float,
                 straggler_threshold: float | None = None):
        self.config = config
        self.draw = draw
        self.tail = TailBatcher(config.tail_batching.eta) if config.tail_batching else None
        self.sizing = GroupSizeController(config.group_sizing) if config.group_sizing else None
        self.history = LengthHistory(default_length)
        self.threshold = (config.group_sizing.straggler_threshold if config.group_sizing
                          else straggler_threshold if straggler_threshold is not None else 1.25)
        self.step = 0

    @property
    def queue_len(self) -> int:
        return len(self.tail.queue) if self.tail else 0

    def next_round(self) -> RoundPlan:
        """The next round; an empty plan when a finite prompt stream and the long queue are both empty."""
        g = self.sizing.choose() if self.sizing else self.config.group_size
        p0 = self.config.responses_per_step // g
        if self.tail is not None:
            return self.tail.plan(p0, g, self.draw)
        prompts = tuple(self.draw(p0))
        return RoundPlan("plain", prompts, g, len(prompts), g)

    def predicted_length(self, entry: PromptEntry) -> float:
        return self.history.predict(entry.uid)

    def finish_round(self, plan: RoundPlan, tracker: RoundTracker, lengths: dict[tuple[int, int], int],
                     partials: dict[int, dict[int, Partial]] | None = None) -> RoundSummary:
        """Close a round: learn lengths, feed SAGC, queue the deferred prompts.

        ``lengths[(prompt, response)]``: tokens every launched response generated (finished or not);
        ``partials[prompt]``: what to keep of a deferred prompt's responses (the runner's outputs).
        """
        if not tracker.done:
            raise ValueError("the round is not over yet")
        finished = {(p, r) for p, rs in enumerate(tracker.finished) for r in rs}
        for p, entry in enumerate(plan.prompts):
            done = [lengths[(p, r)] for r in tracker.finished[p] if (p, r) in lengths]
            self.history.record(entry.uid, done)
            for r in range(plan.launch_of(p)):
                if (p, r) not in finished and (p, r) in lengths:
                    self.history.record_partial(entry.uid, lengths[(p, r)])
        accepted = tracker.accepted()
        groups = [[lengths[(p, r)] for r in rs] for p, rs in accepted]
        stragglers = sum(straggler_ratio(g) > self.threshold for g in groups)
        if self.sizing is not None:
            self.sizing.observe(plan.accept_responses, groups)
        deferred = tracker.deferred() if plan.kind == "short" else []
        if self.tail is not None and deferred:
            entries = []
            for p in deferred:
                entry = plan.prompts[p]
                entry.partials = dict((partials or {}).get(p, {}))
                entries.append(entry)
            self.tail.defer(entries)
        for p, _ in accepted:
            plan.prompts[p].partials = {}
        summary = RoundSummary(self.step, plan.kind, plan.accept_responses, len(plan.prompts), plan.launched,
                               len(accepted), sum(len(rs) for _, rs in accepted), len(deferred), stragglers,
                               self.queue_len)
        self.step += 1
        return summary
