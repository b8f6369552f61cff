"""``EngineRounds``: one RL step's rollout as a tail-batched round, inside an adapter's engine actor.

A framework hands over the step's fresh prompts and its sampling parameters; the rollout
layer (``pat_engine.rollout``: ``RolloutScheduler`` for the round kind and group size,
``RolloutRunner`` for the round on the engine) decides which prompts run, how many responses
each gets, when the round ends and what is deferred. Deferred prompts wait here, with their
partial outputs, for a later step's long round: resumed exactly (prompt + partial tokens, same
seed, budget lowered) when the weights did not change since, regenerated from the prompt when
they did (``weights_updated()`` after every weight sync). Fresh prompts not drawn yet stay
pending for the next step. Nothing of the policies is decided here.

With a reward (a framework's reward function, already in pat's contract: ``reward_conventions.py``)
each response is scored as soon as it finishes, while the round still generates
(``pat_engine.rollout.rewards.RewardStage``); a prompt's metadata (its label, ground truth) comes
with it as ``(uid, prompt, metadata)``. The stage, and so RollPacker's adaptive timeouts, lasts
across steps as long as the same reward comes with each step.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

from pat_engine.outputs import RequestOutput
from pat_engine.rollout.config import RolloutConfig
from pat_engine.rollout.rewards import RewardConfig, RewardFn, RewardResult, RewardStage
from pat_engine.rollout.runner import RolloutRunner, derived_seed
from pat_engine.rollout.scheduler import RolloutScheduler
from pat_engine.rollout.tail_batching import PromptEntry, overprovision
from pat_engine.sampling.params import SamplingParams
from pat_integrations.stage import StagePlan


@dataclass(frozen=True)
class RoundResult:
    """What one step returns: P0 prompts, R0 responses each (outputs in the engine's shape)."""

    kind: str  # "short", "long" or "plain"
    group_size: int  # R0 of this step (SAGC's pick when group sizing is on)
    groups: list[tuple[Hashable, list[RequestOutput]]]  # (prompt uid, its R0 outputs)
    prompts_deferred: int  # prompts this step sent to the long-prompt queue
    queued: int  # prompts waiting for a long round
    pending: int  # fresh prompts handed over and not drawn yet
    wants: int  # fresh prompts to send with the next step so that it can draw as many as it may need
    resumed: int  # responses continued exactly from a partial (same weights)
    stale_regenerated: int  # deferred responses run again from the prompt (the weights changed)
    seconds: float
    start_tp: int
    rewards: list[list[RewardResult]] = field(default_factory=list)  # with a reward: per group, per output
    reward_wait_s: float = 0.0  # waited for rewards after the last token

    def with_outputs(self, convert: Callable[[RequestOutput], Any]) -> "RoundResult":
        """The same result with every output converted to a framework's shape."""
        return dataclasses.replace(self, groups=[(uid, [convert(o) for o in outs]) for uid, outs in self.groups])


class EngineRounds:
    def __init__(self, engine: Any, config: RolloutConfig, plan: StagePlan | None = None, seed: int = 0,
                 name: str = "rollout"):
        if config.tail_batching is None and config.group_sizing is None:
            raise ValueError("EngineRounds needs tail_batching or group_sizing in its RolloutConfig")
        self.engine = engine
        self.config = config
        plan = plan or StagePlan()
        self._stage = ({"switch_schedule": list(plan.switch_schedule), "kv_transfer": plan.kv_transfer}
                       if plan.switch_schedule is not None else {})
        self._seed = seed
        self._name = name
        self._pending: deque[PromptEntry] = deque()
        self._params: SamplingParams | None = None
        self._runner: RolloutRunner | None = None  # built at the first step, when the token budget is known
        self._rewards: RewardStage | None = None  # kept across steps while the reward stays the same

    def weights_updated(self) -> None:
        """After every weight sync: partials from before it are stale (regenerated, not resumed)."""
        if self._runner is not None:
            self._runner.weights_updated()

    def most_drawn(self) -> int:
        """The most fresh prompts one round can draw: a short round at the smallest group size."""
        sizes = self.config.group_sizing.sizes if self.config.group_sizing else (self.config.group_size,)
        p0 = self.config.responses_per_step // min(sizes)
        return overprovision(p0, self.config.tail_batching.eta) if self.config.tail_batching else p0

    def step(self, prompts: Sequence[tuple], params: SamplingParams, reward: RewardFn | None = None,
             reward_config: RewardConfig | None = None) -> RoundResult:
        """Queue ``prompts`` ((uid, prompt) or (uid, prompt, metadata); uid stable across steps) and run one
        round, scoring each response with ``reward`` as it finishes."""
        if params.n != 1:
            raise ValueError(f"a tail-batched step sends one request per response: n must be 1, got {params.n} "
                             "(responses per prompt come from group_size / group_sizing)")
        self._params = params
        self._pending.extend(_entry(p) for p in prompts)
        runner = self._runner or self._start(params)
        runner.rewards = self._reward_stage(reward, reward_config or RewardConfig())
        plan = runner.scheduler.next_round()
        if not plan.prompts:
            raise ValueError("no prompts to run: send fresh prompts with the step")
        res = runner.run_round(plan)
        s = res.summary
        return RoundResult(s.kind, s.group_size, [(e.uid, outs) for e, outs in res.groups], s.prompts_deferred,
                           s.queue_after, len(self._pending), max(self.most_drawn() - len(self._pending), 0),
                           res.resumed, res.stale_regenerated, res.seconds, res.start_tp, res.rewards,
                           res.reward_wait_s)

    def close(self) -> None:
        if self._rewards is not None:
            self._rewards.close()
            self._rewards = None

    def _reward_stage(self, reward: RewardFn | None, config: RewardConfig) -> RewardStage | None:
        if reward is None:
            self.close()  # a step without a reward ends the last one's stage
            return None
        if self._rewards is None or self._rewards.fn is not reward or self._rewards.config != config:
            self.close()
            self._rewards = RewardStage(reward, config)
        return self._rewards

    def _start(self, params: SamplingParams) -> RolloutRunner:
        sched = RolloutScheduler(self.config, self._draw, default_length=params.max_new_tokens / 2)
        predictor = getattr(getattr(self.engine, "policy", None), "predictor", None)
        self._runner = RolloutRunner(self.engine, sched, self._params_for, predictor=predictor, seed=self._seed,
                                     name=self._name, stage_options=self._stage)
        return self._runner

    def _draw(self, n: int) -> list[PromptEntry]:
        return [self._pending.popleft() for _ in range(min(n, len(self._pending)))]

    def _params_for(self, entry: PromptEntry, r: int) -> SamplingParams:
        # a framework's one seed would give every response of a prompt the same draws: one per response
        p = self._params
        return dataclasses.replace(p, seed=derived_seed(p.seed, entry.uid, r)) if p.seed is not None else p


def _entry(prompt: Sequence) -> PromptEntry:
    """``(uid, prompt)`` or ``(uid, prompt, metadata)``."""
    if len(prompt) == 2:
        return PromptEntry(prompt[0], prompt[1])
    if len(prompt) == 3 and isinstance(prompt[2], Mapping):
        return PromptEntry(prompt[0], prompt[1], metadata=dict(prompt[2]))
    raise ValueError(f"each prompt is (uid, prompt) or (uid, prompt, metadata dict), got {len(prompt)} items")


def token_prompts(prompts: Sequence[Sequence], metadata: Callable[[Any], Mapping] = dict) -> list[tuple]:
    """A framework's ``(uid, prompt token ids[, extra])`` as ``step`` takes them: the ids as ints, the extra
    (veRL's row fields, OpenRLHF's label) turned into the prompt's metadata."""
    out = []
    for p in prompts:
        if len(p) not in (2, 3):
            raise ValueError(f"each prompt is (uid, prompt token ids) or (uid, prompt token ids, extra), "
                             f"got {len(p)} items")
        ids = [int(t) for t in p[1]]
        out.append((p[0], ids) if len(p) == 2 else (p[0], ids, metadata(p[2])))
    return out
