"""RolloutRunner: runs the scheduler's rounds on an ``Engine`` through its public API only.

Per step: ``begin_stage`` (back to the base, throughput layout), for a long round
``reconfigure`` to the layout the predictor picks, ``submit`` every request with an
explicit seed, follow finishes through handle listeners into the ``RoundTracker``,
``abort`` the rest once the round is over (aborted requests keep their tokens), and
hand back the accepted groups; a failed or interrupted round aborts all its requests.
Partial outputs of deferred prompts are kept with the weights version they were
generated under: resumed exactly if the weights are unchanged when their long round
comes (and the request can be resumed exactly, ``resume.exactly_resumable``),
regenerated from the prompt otherwise.

With a ``RewardStage`` each response is scored as soon as it is sure to be returned (resumed ones once
joined), while the round still generates: most at once when they finish, one that only an accepted
prompt would return when its prompt completes, and never one that no round returns (a finish past its
prompt's first R0: ``RoundTracker.returned_with``). The step waits only for the rewards still running
when generation ends, so it costs max(generation, last reward) rather than their sum. A deferred prompt's
finished response is scored once: its result is kept for the round that returns it unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Hashable

from pat_engine.errors import PatEngineError, WorkerFailure
from pat_engine.outputs import RequestOutput
from pat_engine.rollout.resume import exactly_resumable, join_outputs, resume_request
from pat_engine.rollout.rewards import RewardResult, RewardStage
from pat_engine.rollout.round_layout import best_round_tp
from pat_engine.rollout.scheduler import RolloutScheduler, RoundSummary
from pat_engine.rollout.tail_batching import Partial, PromptEntry, RoundPlan, RoundTracker
from pat_engine.sampling.params import SamplingParams


@dataclass
class RolloutStep:
    summary: RoundSummary
    groups: list[tuple[PromptEntry, list[RequestOutput]]]  # the P0 prompts returned, R0 outputs each
    seconds: float  # wall time of the round
    start_tp: int  # layout the round started at
    resumed: int  # responses continued from a partial generated under the same weights
    stale_regenerated: int  # deferred responses whose partials were from older weights: run again from the prompt
    weights_version: int
    rewards: list[list[RewardResult]] = field(default_factory=list)  # with a reward stage: per group, per response
    reward_wait_s: float = 0.0  # waited for rewards after the last token

    @property
    def outputs(self) -> list[RequestOutput]:
        return [o for _, outs in self.groups for o in outs]


def derived_seed(*parts) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


@dataclass
class _Job:
    key: tuple[int, int]
    request_id: str
    prompt: object
    params: SamplingParams
    prefix: Partial | None  # resumed from this partial
    predicted: float


class RolloutRunner:
    def __init__(self, engine, scheduler: RolloutScheduler,
                 params_for: Callable[[PromptEntry, int], SamplingParams], predictor=None,
                 seed: int = 0, name: str = "rollout",
                 stage_options: dict | None = None, rewards: RewardStage | None = None):
        self.engine = engine
        self.rewards = rewards  # scores responses while the round generates (None: the caller scores)
        self.stage_options = dict(stage_options or {})  # begin_stage's switch_schedule / policy / kv_transfer
        self.scheduler = scheduler
        self.params_for = params_for
        self.predictor = predictor
        self.seed = seed
        self.name = name
        self.weights_version = 0
        # a deferred prompt's finished responses' rewards, by (prompt uid, response): the response comes back
        # as it was in a later round (a finished partial under the same weights), so its reward does too
        self._kept_rewards: dict[tuple[Hashable, int], RewardResult] = {}

    def weights_updated(self) -> None:
        """Call after every ``update_weights``: partials from before become stale (their rewards with them)."""
        self.weights_version += 1
        self._kept_rewards.clear()

    # ---- one round ------------------------------------------------------------------------------------

    def step(self) -> RolloutStep:
        """Plan the next round and run it."""
        return self.run_round(self.scheduler.next_round())

    def run_round(self, plan: RoundPlan) -> RolloutStep:
        """Run a round the scheduler planned; on any failure the round's requests are aborted first."""
        if not plan.prompts:
            raise ValueError("empty round: the prompt stream and the long-prompt queue are both empty")
        sched, engine = self.scheduler, self.engine
        step = sched.step
        tracker = RoundTracker(plan)
        jobs, instant, resumed, stale = self._jobs(plan, step)
        engine.begin_stage(from_base_layout=True, **self.stage_options)
        if plan.kind == "long":
            self._long_round_layout(jobs)
        start_tp = engine.layout.tp
        t0 = time.perf_counter()
        handles: dict = {}
        for key, out in instant.items():
            if self._kept_key(plan, key) not in self._kept_rewards:
                self._score(plan, step, key, out)
        try:
            self._follow(tracker, jobs, instant, handles, plan, step)
        except BaseException:
            with contextlib.suppress(PatEngineError):  # nothing of a failed (or interrupted) round runs on
                engine.abort([h.request_id for h in handles.values() if not h.done()])
            raise
        seconds = time.perf_counter() - t0
        outputs = dict(instant)
        for job in jobs:
            out = handles[job.key].output()
            if job.prefix is not None:
                out = self._joined(job.prefix, out, plan.prompts[job.key[0]])
            outputs[job.key] = replace(out, sample_index=job.key[1])  # the response's index within its prompt
            if job.prefix is not None and out.finish_reason in ("stop", "length"):
                self._score(plan, step, job.key, outputs[job.key])  # a resumed response is scored whole
        lengths = {k: len(o.token_ids) for k, o in outputs.items()}
        partials = self._partials(plan, tracker, outputs, {j.key: j.params for j in jobs})
        summary = sched.finish_round(plan, tracker, lengths, partials)
        accepted = tracker.accepted()
        groups = [(plan.prompts[p], [outputs[(p, r)] for r in rs]) for p, rs in accepted]
        rewards, waited = self._collect_rewards(plan, step, accepted, tracker.deferred())
        return RolloutStep(summary, groups, seconds, start_tp, resumed, stale, self.weights_version, rewards, waited)

    def _follow(self, tracker: RoundTracker, jobs: list[_Job], instant: dict, handles: dict, plan: RoundPlan,
                step: int) -> None:
        """Submit the round, feed finishes to the tracker until it closes, abort the late requests."""
        engine = self.engine
        events: queue.Queue = queue.Queue()
        resumed = {j.key for j in jobs if j.prefix is not None}
        for key in instant:  # finished partials under the current weights: done already
            tracker.on_finished(*key)
        for job in jobs:
            h = engine.submit(job.prompt, job.params, request_id=job.request_id)
            h.add_listener(lambda handle, key=job.key: events.put(key) if handle.done() else None)
            handles[job.key] = h
            if h.done():
                events.put(job.key)
        seen: set = set(instant)
        while not tracker.done:
            try:
                key = events.get(timeout=1.0)
            except queue.Empty:
                if all(h.done() for h in handles.values()) and events.empty():
                    raise WorkerFailure("every request ended but the round is not complete",
                                        partial_outputs=[h.output() for h in handles.values()]) from None
                continue
            if key in seen:
                continue
            seen.add(key)
            out = handles[key].output()
            if out.finish_reason in ("abort", "error"):
                raise WorkerFailure(f"request {out.request_id} ended with {out.finish_reason}: {out.error}",
                                    partial_outputs=[h.output() for h in handles.values()])
            tracker.on_finished(*key)
            for r in tracker.returned_with(*key):  # score only what will be returned: no reward is wasted
                sure = (key[0], r)
                if sure not in resumed and sure not in instant:  # resumed: scored once joined to its prefix
                    self._score(plan, step, sure, replace(handles[sure].output(), sample_index=r))
        engine.abort([handles[k].request_id for k in tracker.unfinished() if k in handles])
        for h in handles.values():
            h.wait()

    # ---- rewards ----------------------------------------------------------------------------------------

    def _score(self, plan: RoundPlan, step: int, key: tuple[int, int], out: RequestOutput) -> None:
        """Hand a finished response to the reward stage with its prompt and the prompt's metadata; the
        prompt anchors the adaptive timeout."""
        if self.rewards is not None:
            entry = plan.prompts[key[0]]
            prompt = entry.prompt if isinstance(entry.prompt, str) else list(out.prompt_token_ids)
            self.rewards.submit((step, key), out, task=entry.uid, prompt=prompt, metadata=entry.metadata)

    def _collect_rewards(self, plan: RoundPlan, step: int, accepted,
                         deferred: list[int]) -> tuple[list[list[RewardResult]], float]:
        """Wait for what is still being scored; the returned groups' results, in the groups' order (a
        response that came back as it was takes the result kept when it was scored). Deferred prompts'
        results are kept for the round that returns them."""
        if self.rewards is None:
            return [], 0.0
        t = time.perf_counter()
        got = {r.key[1]: r for r in self.rewards.drain() if r.key[0] == step}
        for p in deferred:
            self._kept_rewards.update({self._kept_key(plan, k): r for k, r in got.items() if k[0] == p})
        groups = [[got.get((p, r)) or replace(self._kept_rewards.pop(self._kept_key(plan, (p, r))), key=(step, (p, r)))
                   for r in rs] for p, rs in accepted]
        for p, rs in accepted:  # nothing of a returned prompt stays kept
            for r in range(plan.launch_of(p)):
                self._kept_rewards.pop(self._kept_key(plan, (p, r)), None)
        return groups, time.perf_counter() - t

    @staticmethod
    def _kept_key(plan: RoundPlan, key: tuple[int, int]) -> tuple[Hashable, int]:
        return plan.prompts[key[0]].uid, key[1]

    # ---- helpers ----------------------------------------------------------------------------------------

    def _jobs(self, plan: RoundPlan, step: int):
        jobs, instant, resumed, stale = [], {}, 0, 0
        for p, entry in enumerate(plan.prompts):
            predicted = self.scheduler.predicted_length(entry)
            for r in range(plan.launch_of(p)):
                key = (p, r)
                rid = f"{self.name}-s{step}-u{entry.uid}-r{r}"
                part = entry.partials.get(r)
                current = (part is not None and part.weights_version == self.weights_version
                           and self.scheduler.config.tail_batching.resume_partials)
                if current and part.finished:  # returned as it was
                    instant[key] = (replace(part.output, request_id=rid, sample_index=r) if part.output is not None
                                    else self._decoded(RequestOutput(rid, part.prompt_token_ids, list(part.token_ids),
                                                                     None, part.finish_reason, part.logprobs)))
                    resumed += 1
                    continue
                if current and len(part.token_ids) < part.params.max_new_tokens and exactly_resumable(part.params):
                    prompt, params = resume_request(part.prompt_token_ids, part.token_ids, part.params)
                    jobs.append(_Job(key, rid, prompt, params, part, predicted))
                    resumed += 1
                    continue
                if part is not None and part.weights_version != self.weights_version:
                    stale += 1  # older weights: the staleness rule regenerates it from the prompt
                # same weights but not resumable exactly: run again from the prompt with the same parameters
                params = part.params if current else self.params_for(entry, r)
                if params.seed is None:
                    params = replace(params, seed=derived_seed(self.seed, step, entry.uid, r))
                jobs.append(_Job(key, rid, entry.prompt, params, None, predicted))
        return jobs, instant, resumed, stale

    def _partials(self, plan: RoundPlan, tracker: RoundTracker, outputs, params) -> dict[int, dict[int, Partial]]:
        if plan.kind != "short":
            return {}
        out: dict[int, dict[int, Partial]] = {}
        for p in tracker.deferred():
            keep = {}
            for r in range(min(plan.launch_of(p), plan.accept_of(p))):  # the long round runs responses 0..R0-1
                o = outputs[(p, r)]
                if (p, r) not in params:
                    continue
                reason = o.finish_reason if o.finish_reason in ("stop", "length") else None
                keep[r] = Partial(list(o.prompt_token_ids), list(o.token_ids), o.logprobs, reason,
                                  self.weights_version, params[(p, r)], o if reason is not None else None)
            out[p] = keep
        return out

    def _prompt_len(self, prompt) -> int:
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        tok = getattr(self.engine, "tokenizer", None)
        if isinstance(prompt, str) and tok is not None:
            return len(tok.encode(prompt))
        return max(len(str(prompt)) // 4, 1)  # chat messages or no tokenizer: a rough size is enough for the layout's pricing

    def _joined(self, prefix: Partial, rest: RequestOutput, entry: PromptEntry) -> RequestOutput:
        """A resumed response as one output: the partial's tokens, then the continuation's; its text
        decoded as the engine decodes, its prompt text kept when it was sent as text."""
        out = join_outputs(prefix.prompt_token_ids, prefix.token_ids, prefix.logprobs, rest)
        return replace(self._decoded(out), prompt=entry.prompt if isinstance(entry.prompt, str) else None)

    def _decoded(self, out: RequestOutput) -> RequestOutput:
        """A joined output's text, by the engine's own detokenizing rule."""
        return replace(out, text=self.engine.request_factory.decode(out.token_ids))

    def _long_round_layout(self, jobs: list[_Job]) -> None:
        if self.predictor is None or not self.scheduler.config.predictor_long_round_layout or not jobs:
            return
        plens = [self._prompt_len(j.prompt) for j in jobs]
        cap = max(j.params.max_new_tokens for j in jobs)
        tp = best_round_tp(self.predictor, self.engine.config.world, plens, [j.predicted for j in jobs], cap)
        if tp != self.engine.layout.tp:
            self.engine.reconfigure(tp)
