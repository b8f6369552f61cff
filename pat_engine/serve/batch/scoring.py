"""``pat-serve batch --reward``: each line's answers scored as they finish, while the rest still generate.

Between the engine and the output file: without a reward a finished line is written at once; with
one, each of its answers goes to the reward stage (``pat_engine.rollout.rewards``: a bounded pool,
RollPacker's adaptive timeouts, each line anchoring its own) and the line is written when the last
of its rewards is in. A failed reward never loses the line: its record keeps the answers and says
which reward failed (``lines.result_record``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from pat_engine.outputs import RequestOutput
from pat_engine.rollout.rewards import RewardConfig, RewardFn, RewardResult, RewardStage
from pat_engine.serve.batch.lines import BatchItem
from pat_engine.serve.batch.summary import RewardCounts

WriteLine = Callable[[BatchItem, list[RequestOutput], "list[RewardResult] | None"], None]


@dataclass(frozen=True)
class BatchReward:
    fn: RewardFn  # reward_fns.reward_from_spec(--reward)
    config: RewardConfig = field(default_factory=RewardConfig)


class LineScorer:
    """Collects a line's answers' rewards and writes the line once they are all in."""

    def __init__(self, reward: BatchReward | None, write: WriteLine, poll_s: float = 0.05):
        self.stage = RewardStage(reward.fn, reward.config) if reward is not None else None
        self.write = write
        self.poll_s = poll_s  # how long the job's loop waits for a finished line before looking at rewards
        self.counts = RewardCounts()
        self._waiting: dict[int, tuple[BatchItem, list[RequestOutput], dict[int, RewardResult]]] = {}

    def finished(self, item: BatchItem, outs: list[RequestOutput]) -> None:
        """A line's answers are all generated: write it, or score them first."""
        if self.stage is None or any(o.finish_reason == "error" for o in outs):
            self.write(item, outs, None)  # a failed generation is the line's error: nothing to score
            return
        self._waiting[item.line] = (item, outs, {})
        for i, out in enumerate(outs):
            self.stage.submit((item.line, i), out, task=item.line, prompt=_prompt(item, out), metadata=item.metadata)

    def poll(self) -> None:
        """Write the lines whose rewards have all come in, without waiting."""
        if self.stage is not None:
            for result in self.stage.ready():
                self._take(result)

    def finish(self) -> None:
        """After the last answer: wait for the rewards still running and write their lines."""
        if self.stage is None:
            return
        t = time.perf_counter()
        for result in self.stage.results():
            self._take(result)
        self.counts.wait_s += time.perf_counter() - t

    def close(self) -> None:
        if self.stage is not None:
            self.stage.close()

    def _take(self, result: RewardResult) -> None:
        line, index = result.key
        self.counts.scored += 1
        self.counts.failed += not result.ok
        item, outs, got = self._waiting[line]
        got[index] = result
        if len(got) == len(outs):
            del self._waiting[line]
            self.write(item, outs, [got[i] for i in range(len(outs))])


def _prompt(item: BatchItem, out: RequestOutput) -> object:
    """What the engine ran: the line's text (a chat as its template rendered it), else the token ids."""
    if item.input.rendered is not None:
        return item.input.rendered
    return item.input.prompt if isinstance(item.input.prompt, str) else list(out.prompt_token_ids)
