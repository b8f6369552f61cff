"""``pat-serve batch --tail-batching``: the file's lines as a stream of tail-batched rounds (RollPacker).

Every line is a prompt that wants its own ``n`` answers (R0, per line). With
P0 = ``--prompts-per-round`` and eta = ``--tail-eta``, the rollout layer plans and
runs the rounds (``RolloutScheduler`` / ``RolloutRunner``, docs/rollout.md):

- a **short round** launches the next ceil(P0(1+eta)) lines, ceil(n(1+eta)) responses
  each, and ends as soon as P0 of them have n finished responses. Those P0 are written
  (n answers each, the record a plain job writes); their surplus responses are dropped;
  the other lines wait in the long queue with their partial outputs;
- a **long round** runs exactly the P0 oldest waiting lines, n responses each, no
  over-provisioning, resumed from their partials. Weights never change inside a job,
  so a resumed answer is exactly the uninterrupted one;
- at the end of the file the lines still waiting run in a final long round: every line
  is answered, or gets an error record (a round that fails writes one per line).

Seeds: response i of a line seeded s uses ``sample_seed(s, i)``, the seed a plain job
gives sample i of that line, so a deferred line's answers are token for token what a
plain job writes for it. A line without a seed gets s derived from the engine seed and
its key (a plain job draws one per request instead), so a rerun or ``--resume``
reproduces it. The engine's switch policy keeps running inside every round (a fixed
schedule counts decode steps from the start of each round). With ``--reward`` the runner's
reward stage scores each answer as it finishes; a round's lines are written with their rewards.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

from pat_engine.core.engine import Engine
from pat_engine.errors import InvalidRequestError, WorkerFailure
from pat_engine.predictor.policy import ScheduledSwitches
from pat_engine.rollout.config import RolloutConfig, TailBatchingConfig
from pat_engine.rollout.rewards import RewardStage
from pat_engine.rollout.runner import RolloutRunner, derived_seed
from pat_engine.rollout.scheduler import RolloutScheduler
from pat_engine.rollout.tail_batching import PromptEntry
from pat_engine.sampling.seeds import sample_seed
from pat_engine.sampling.params import SamplingParams
from pat_engine.serve.batch.lines import BatchItem, error_record
from pat_engine.serve.batch.scoring import BatchReward
from pat_engine.serve.batch.summary import RewardCounts, RoundCounts


class RecordSink(Protocol):
    def write(self, record: dict, prompt_tokens: int = 0, tokens: int = 0) -> None: ...

    def line(self, item: BatchItem, outs: list, rewards: list | None, tokenizer: Any, model: str) -> None: ...


@dataclass(frozen=True)
class TailBatchPolicy:
    prompts_per_round: int  # P0: lines each round returns
    eta: float = TailBatchingConfig.eta

    def __post_init__(self) -> None:
        if self.prompts_per_round < 1:
            raise InvalidRequestError(f"--prompts-per-round must be at least 1, got {self.prompts_per_round}")
        self.rollout_config()  # checks eta

    def rollout_config(self) -> RolloutConfig:
        # group_size 1 makes the step's P0 = responses_per_step; each line brings its own R0 (PromptEntry.responses)
        return RolloutConfig(responses_per_step=self.prompts_per_round, group_size=1,
                             tail_batching=TailBatchingConfig(eta=self.eta))


def run_rounds(engine: Engine, items: list[BatchItem], policy: TailBatchPolicy, out: RecordSink, model: str,
               on_round: Callable[[], None] = lambda: None,
               reward: BatchReward | None = None) -> tuple[RoundCounts, RewardCounts | None]:
    """Answer every item through tail-batched rounds, writing one record per line to ``out``."""
    stage = RewardStage(reward.fn, reward.config) if reward is not None else None
    try:
        return _rounds(engine, items, policy, out, model, on_round, stage)
    finally:
        if stage is not None:
            stage.close()


def _rounds(engine: Engine, items: list[BatchItem], policy: TailBatchPolicy, out: RecordSink, model: str,
            on_round: Callable[[], None], stage: RewardStage | None) -> tuple[RoundCounts, RewardCounts | None]:
    lines: dict[int, BatchItem] = {}
    stream = iter(_runnable(engine, items, out))  # checked up front, at the base layout every round starts at

    def draw(k: int) -> list[PromptEntry]:
        taken = list(itertools.islice(stream, k))
        lines.update((it.line, it) for it in taken)
        return [PromptEntry(it.line, it.input.prompt, responses=it.input.params.n, metadata=it.metadata)
                for it in taken]

    def params_for(entry: PromptEntry, r: int) -> SamplingParams:
        item = lines[entry.uid]
        p = item.input.params
        base = p.seed if p.seed is not None else derived_seed(engine.config.seed, item.key)
        return replace(p, n=1, seed=sample_seed(base, r))

    # A file's lines come once, so no length history exists: a line's own max_new_tokens is its
    # predicted length for the long rounds' layout, which the profile table's predictor picks when
    # one is loaded.
    longest = max((it.input.params.max_new_tokens for it in items), default=1)
    sched = RolloutScheduler(policy.rollout_config(), draw, default_length=float(longest))
    runner = RolloutRunner(engine, sched, params_for, predictor=getattr(engine.policy, "predictor", None),
                           seed=engine.config.seed, name="batch", stage_options=_per_round(engine.policy),
                           rewards=stage)
    counts, scored = RoundCounts(), RewardCounts() if stage is not None else None
    while (plan := sched.next_round()).prompts:
        try:
            res = runner.run_round(plan)
        except WorkerFailure as exc:
            if engine.dead:
                raise  # nothing more can run; --resume redoes what is not written
            counts.failed += 1
            for entry in plan.prompts:
                item = lines.pop(entry.uid)
                out.write(error_record(item.error(f"generation failed: {str(exc).splitlines()[0]}", status=500)))
            continue
        s = res.summary
        counts.short += s.kind == "short"
        counts.long += s.kind == "long"
        counts.prompts += s.prompts_launched if s.kind == "short" else 0
        counts.deferred += s.prompts_deferred
        counts.resumed += res.resumed
        if scored is not None:
            scored.wait_s += res.reward_wait_s
        for g, (entry, outs) in enumerate(res.groups):
            _write_line(out, lines.pop(entry.uid), outs, res.rewards[g] if stage is not None else None, engine, model,
                        scored)
        on_round()
    return counts, scored


def _write_line(out: RecordSink, item: BatchItem, outs: list, rewards: list | None, engine: Engine, model: str,
                scored: RewardCounts | None) -> None:
    """A returned line's record: its answers by response index, numbered as the line's samples (sample 0
    carries the prompt in the usage), each with its reward."""
    order = sorted(range(len(outs)), key=lambda i: outs[i].sample_index)
    samples = [replace(outs[i], sample_index=k) for k, i in enumerate(order)]
    if rewards is not None:
        rewards = [rewards[i] for i in order]
        scored.scored += len(rewards)
        scored.failed += sum(not r.ok for r in rewards)
    out.line(item, samples, rewards, engine.tokenizer, model)


def _per_round(policy: object) -> dict:
    """Every round is a generation stage (back to the base layout, decode steps from 0): a fixed
    ``--switch-schedule`` is replayed in each round; a controller keeps deciding on its own."""
    if isinstance(policy, ScheduledSwitches):
        return {"switch_schedule": list(policy.schedule), "kv_transfer": policy.kv_path}
    return {}


def _runnable(engine: Engine, items: list[BatchItem], out: RecordSink) -> list[BatchItem]:
    """The items the engine accepts; the others get their error record now (a round must not fail on them)."""
    ok = []
    for item in items:
        try:
            engine.check_request(item.input.prompt, item.input.params)
        except InvalidRequestError as exc:
            out.write(error_record(item.error(str(exc))))
        else:
            ok.append(item)
    return ok
