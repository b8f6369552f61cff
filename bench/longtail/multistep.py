"""Multi-step rollout simulation: the rollout layer's policies over many RL steps, on a profile table.

A prompt dataset whose per-prompt response-length distribution persists across steps
(a latent difficulty per prompt: long-tail prompts stay long-tail, as RollPacker and SAGC
observe) feeds ``pat_engine.rollout.RolloutScheduler`` -- the same tail batching and SAGC
code the engine-facing runner uses -- and each round is replayed by the
discrete-event simulator (``longtail.simulator.Simulation``), stopped the moment the
round's ``RoundTracker`` says it is over (the rest is aborted). Weights change after
every step, so every deferred partial is stale and its long round regenerates it from
the prompt (the staleness rule); responses returned are all from the current step.

Not modelled: reward computation and training (and their overlap with rollout, which
RollPacker's end-to-end figures include), KV capacity and preemption, abort latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from longtail.policies import distribution_policy
from longtail.simulator import Simulation
from longtail.workload import Batch, LongTail
from pat_engine.predictor.predictor import LatencyPredictor
from pat_engine.rollout import PromptEntry, RolloutConfig, RolloutScheduler, RoundTracker
from pat_engine.rollout.round_layout import best_round_tp


@dataclass
class PromptDataset:
    """Prompts with a persistent difficulty; responses drawn per launch, reproducible per (prompt, launch)."""

    size: int
    dist: LongTail
    cap: int
    prompt_range: tuple[int, int]
    seed: int = 0

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.z = rng.standard_normal(self.size)
        self.prompt_lens = rng.integers(self.prompt_range[0], self.prompt_range[1] + 1, self.size)
        self._order = np.random.default_rng(self.seed + 1).permutation(self.size)
        self._launches: dict[int, int] = {}

    def fresh_draw(self) -> Callable[[int], list[PromptEntry]]:
        """A drawer of fresh prompts in the dataset's (seeded, repeated) epoch order; one per run."""
        pos = [0]

        def draw(n: int) -> list[PromptEntry]:
            out = []
            for _ in range(n):
                epoch, k = divmod(pos[0], self.size)
                uid = int(np.random.default_rng((self.seed, epoch)).permutation(self.size)[k]) if epoch else \
                    int(self._order[k])
                out.append(PromptEntry(uid, uid))
                pos[0] += 1
            return out

        return draw

    def lengths(self, uid: int, launch: int, n: int) -> np.ndarray:
        zs = np.random.default_rng((self.seed, 7, uid, launch)).standard_normal(n)
        c = self.dist.prompt_corr  # share of log-length variance that belongs to the prompt (persists)
        z = math.sqrt(c) * self.z[uid] + math.sqrt(1 - c) * zs
        return np.clip(np.round(np.exp(self.dist.mu + self.dist.sigma * z) * self.dist.scale), 1, self.cap).astype(
            np.int64)


class RoundSimulation(Simulation):
    """A Simulation that stops when ``on_finish`` says so."""

    def __init__(self, *args, on_finish: Callable[[int], bool] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_finish = on_finish
        self.stopped_at: float | None = None

    def _finish(self, i: int) -> None:
        super()._finish(i)
        if self.stopped_at is None and self.on_finish is not None and self.on_finish(i):
            self.stopped_at = self.now

    def run_round(self) -> float:
        """Run until the round is over; its duration (seconds)."""
        while self.stopped_at is None:
            check_due = self._advance()
            if check_due is None:
                break
            if check_due:
                self._ask_policy()
        return self.stopped_at if self.stopped_at is not None else self.finished_at


@dataclass(frozen=True)
class Variant:
    label: str
    config: RolloutConfig
    pat: bool = False  # the switch controller runs inside every round
    short_tp: int | None = None  # static TP of short (and plain) rounds; None: the throughput layout
    long_tp: int | None = None  # static TP of long rounds; None: the predictor's pick (with pat) or short_tp


@dataclass
class StepRecord:
    step: int
    kind: str
    group_size: int
    tp: int
    seconds: float
    switches: int
    launched: int
    returned: int
    prompts_launched: int
    prompts_deferred: int
    stragglers: int
    groups: int
    max_age: int  # steps between the weights a returned response was generated under and this step's


@dataclass
class RunResult:
    variant: Variant
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(s.seconds for s in self.steps)


def throughput_tp(pred: LatencyPredictor, n: int, context: float, world: int) -> int:
    def step(tp: int) -> float:
        b = -(-n // (world // tp))
        return pred.decode.scalar(tp, b, b * context)

    return min(pred.tps, key=lambda tp: (step(tp), tp))


def run_variant(variant: Variant, data: PromptDataset, pred: LatencyPredictor, world: int, steps: int,
                max_num_seqs: int, check_interval: int, draws: int = 8) -> RunResult:
    cfg = variant.config
    sched = RolloutScheduler(cfg, data.fresh_draw(), default_length=float(np.exp(data.dist.mu)) * data.dist.scale)
    launches: dict[int, int] = {}
    history: list[np.ndarray] = []
    out = RunResult(variant)
    base = throughput_tp(pred, cfg.responses_per_step, float(np.mean(data.prompt_range)), world)
    for step in range(steps):
        plan = sched.next_round()
        keys = [(p, r) for p in range(len(plan.prompts)) for r in range(plan.responses)]
        lens = np.empty(len(keys), np.int64)
        plens = np.empty(len(keys), np.int64)
        for p, entry in enumerate(plan.prompts):
            n = launches.get(entry.uid, 0)
            launches[entry.uid] = n + 1
            lens[p * plan.responses:(p + 1) * plan.responses] = data.lengths(entry.uid, n, plan.responses)
            plens[p * plan.responses:(p + 1) * plan.responses] = data.prompt_lens[entry.uid]
        predicted = np.array([sched.predicted_length(plan.prompts[p]) for p, _ in keys])
        if plan.kind == "long":
            tp = variant.long_tp or (best_round_tp(pred, world, plens, predicted, data.cap) if variant.pat
                                     else variant.short_tp or base)
        else:
            tp = variant.short_tp or base
        tracker = RoundTracker(plan)
        policy = distribution_policy(pred, check_interval, history[-4:], data.cap, draws=draws, seed=step) \
            if variant.pat else None
        sim = RoundSimulation(pred, Batch(plens, lens, data.cap), tp, world, max_num_seqs, check_interval, policy,
                              on_finish=lambda i: tracker.on_finished(*keys[i]))
        seconds = sim.run_round()
        tokens = sim.generated.copy()
        for g in sim.groups:
            for i in g.running:
                tokens[i] = sim._tokens(g, i)
        # finished: its full length; aborted: what it had when the round ended (a lower bound)
        generated = {key: int(lens[i]) if np.isfinite(sim.done_at[i]) and sim.done_at[i] <= seconds else int(tokens[i])
                     for i, key in enumerate(keys)}
        done_lengths = np.array([lens[i] for i in range(len(keys)) if np.isfinite(sim.done_at[i])
                                 and sim.done_at[i] <= seconds])
        history.append(done_lengths)
        # every request of a round is launched (from its prompt) under this step's weights; partials of
        # deferred prompts are never handed to the scheduler, so nothing older can be returned
        launched_at = {key: step for key in keys}
        age = max((step - launched_at[(p, r)] for p, rs in tracker.accepted() for r in rs), default=0)
        summary = sched.finish_round(plan, tracker, generated)
        out.steps.append(StepRecord(step, plan.kind, plan.accept_responses, tp, seconds, len(sim.switches),
                                    plan.launched, summary.responses_returned, summary.prompts_launched,
                                    summary.prompts_deferred, summary.stragglers, summary.prompts_returned, age))
    return out
