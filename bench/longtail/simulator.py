"""Discrete-event replay of one rollout batch on a TP/DP deployment, driven by a profile table.

Mirrors the engine's coordinator: DP groups step independently (a step's
latency is the table's fit at the group's batch and total context); a group
prefills newly admitted requests (one prefill step, the table's prefill time
at their RMS length), otherwise decodes every running request; every
``check_interval`` decode steps of the busiest group the policy is asked; a
requested switch waits for in-flight steps, redistributes the unfinished
requests with the engine's balancing rule, and costs what the predictor's
switch-cost model says (weights + fixed, plus the KV migration time, or a
re-prefill of every request under the new layout when recompute is cheaper).

Per request, progress is kept implicitly: a request that joined its group at
group step j with g tokens has g + (n - j) tokens at group step n, so a decode
step is O(1) plus O(log n) per finish.

The simulator's predictor is the truth (steps, prefills, switch costs); a policy may price with another
(a table that is off, bench/simulate_calibration.py) and learn from the steps through ``observer``.

Not modelled: KV capacity and preemption (groups admit up to ``max_num_seqs``),
step-time noise, prefill chunking.
"""

from __future__ import annotations

import copy
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pat_engine.predictor.policy import ClusterStatus, GroupSnapshot, RequestSnapshot, SwitchPolicy
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.drain import drain_seconds
from pat_engine.predictor.kv_path_cost import rms_context
from pat_engine.parallel.dp_placement import balance_by_context
from pat_engine.predictor.predictor import LatencyPredictor
from longtail.workload import Batch


@dataclass
class Group:
    running: dict[int, tuple[int, int]] = field(default_factory=dict)  # req -> (join step, tokens at join)
    finish: list[tuple[int, int]] = field(default_factory=list)  # heap of (group step it ends at, req)
    waiting: deque = field(default_factory=deque)
    steps: int = 0  # decode steps done
    base: int = 0  # sum over running of (prompt + tokens at join - join step)
    busy_until: float | None = None  # end of the step in flight
    inflight: tuple | None = None  # ("prefill", reqs) or ("decode", batch, total context, seconds)


@dataclass
class SwitchRecord:
    t: float
    from_tp: int
    to_tp: int
    active: int
    cost_s: float
    kv_path: str
    details: dict


class Simulation:
    def __init__(self, predictor: LatencyPredictor, batch: Batch, tp: int, world: int, max_num_seqs: int,
                 check_interval: int, policy: SwitchPolicy | None = None,
                 observer: Callable[[int, int, float, float], None] | None = None):
        self.pred = predictor
        self.observer = observer  # told every decode step: (tp, batch, total context, seconds)
        self.prompt = batch.prompt_lens.astype(np.int64)
        self.target = np.minimum(batch.lengths, batch.cap).astype(np.int64)
        self.cap = batch.cap
        self.max_num_seqs = max_num_seqs
        self.k = check_interval
        self.policy = policy
        self.layout = Layout.for_world(world, tp)
        self.now = 0.0
        self.stage_step = 0
        self.pending: int | None = None
        self.generated = np.zeros(len(self.target), np.int64)  # valid for requests not running
        self.done_at = np.full(len(self.target), np.nan)
        self.cached = np.zeros(len(self.target), bool)
        self.groups = [Group() for _ in range(self.layout.dp)]
        self.switches: list[SwitchRecord] = []
        self.timeline: list[tuple[float, int, int]] = [(0.0, len(self.target), tp)]  # (t, active, tp)
        # requests go to the group with the fewest outstanding tokens (the coordinator's routing)
        load = [0] * self.layout.dp
        for i in range(len(self.target)):
            g = min(range(self.layout.dp), key=lambda j: (load[j], j))
            self.groups[g].waiting.append(i)
            load[g] += int(self.prompt[i]) + self.cap
        self.active = len(self.target)
        self._pending_details: dict = {}

    # ---- latency ----------------------------------------------------------------------------------

    def _step_s(self, b: int, total: float) -> float:
        return self.pred.decode.scalar(self.layout.tp, b, total)

    # ---- the loop -------------------------------------------------------------------------------------

    def run(self, stop_at_checks: bool = False) -> bool:
        """Advance; with ``stop_at_checks`` return False at each policy check (state = what a policy sees).

        Returns True when every request is done.
        """
        while True:
            check_due = self._advance()
            if check_due is None:
                return True
            if check_due:
                if stop_at_checks:
                    return False
                self._ask_policy()

    def _advance(self) -> bool | None:
        """One event: a pending switch once every group is idle, idle groups dispatched, then the next step
        to finish completes. None when nothing runs; else whether a policy check is due."""
        if self.pending is not None and all(g.inflight is None for g in self.groups):
            self._switch(self.pending)
        if self.pending is None:
            for g in self.groups:
                if g.inflight is None:
                    self._dispatch(g)
        live = [g for g in self.groups if g.inflight is not None]
        if not live:
            return None
        g = min(live, key=lambda x: x.busy_until)
        self.now = g.busy_until
        return bool(self._complete(g) and self.active)

    def _dispatch(self, g: Group) -> None:
        if g.waiting and len(g.running) < self.max_num_seqs:
            admit = [g.waiting.popleft() for _ in range(min(len(g.waiting), self.max_num_seqs - len(g.running)))]
            ctx = [int(self.prompt[i] + self.generated[i]) for i in admit]
            g.inflight = ("prefill", admit)
            g.busy_until = self.now + self.pred.prefill_seconds(self.layout.tp, len(admit), rms_context(ctx))
        elif g.running:
            b = len(g.running)
            total = g.base + b * g.steps
            seconds = self._step_s(b, total)
            g.inflight = ("decode", b, total, seconds)
            g.busy_until = self.now + seconds

    def _complete(self, g: Group) -> bool:
        """Apply a finished step; True when the stage reached a policy check."""
        kind = g.inflight[0]
        if kind == "decode" and self.observer is not None:
            self.observer(self.layout.tp, *g.inflight[1:])
        if kind == "prefill":
            for i in g.inflight[1]:
                self.generated[i] += 1  # the prefill samples one token
                self.cached[i] = True
                if self.generated[i] >= self.target[i]:
                    self._finish(i)
                else:
                    self._join(g, i)
        g.inflight, g.busy_until = None, None
        if kind != "decode":
            return False
        g.steps += 1
        while g.finish and g.finish[0][0] <= g.steps:
            _, i = heapq.heappop(g.finish)
            join, tokens = g.running.pop(i)
            g.base -= int(self.prompt[i]) + tokens - join
            self.generated[i] = self.target[i]
            self._finish(i)
        if g.steps > self.stage_step:
            self.stage_step = g.steps
            if self.stage_step % self.k == 0:
                self.timeline.append((self.now, self.active, self.layout.tp))
                return True
        return False

    def _join(self, g: Group, i: int) -> None:
        tokens = int(self.generated[i])
        g.running[i] = (g.steps, tokens)
        g.base += int(self.prompt[i]) + tokens - g.steps
        heapq.heappush(g.finish, (g.steps + int(self.target[i]) - tokens, i))

    def _finish(self, i: int) -> None:
        self.done_at[i] = self.now
        self.active -= 1
        if self.active == 0:
            self.timeline.append((self.now, 0, self.layout.tp))

    def _tokens(self, g: Group, i: int) -> int:
        join, tokens = g.running[i]
        return tokens + g.steps - join

    # ---- policy and switches ---------------------------------------------------------------------------

    def status(self) -> ClusterStatus:
        groups = []
        for gi, g in enumerate(self.groups):
            reqs = [RequestSnapshot(int(self.prompt[i]), self._tokens(g, i), self.cap, True) for i in g.running]
            reqs += [RequestSnapshot(int(self.prompt[i]), int(self.generated[i]), self.cap, bool(self.cached[i]))
                     for i in g.waiting]
            groups.append(GroupSnapshot(gi, tuple(reqs), 0, 0, None))
        return ClusterStatus(self.now, self.layout, tuple(groups), self.stage_step, 16)

    def _ask_policy(self) -> None:
        if self.policy is None or self.pending is not None:
            return
        decision = self.policy.decide(self.status())
        if decision is not None and decision.tp != self.layout.tp:
            self.pending = decision.tp
            self._pending_details = decision.details

    def request_switch(self, tp: int) -> None:
        """What a policy's decision does: switch once in-flight steps are done."""
        if tp != self.layout.tp:
            self.pending = tp
            self._pending_details = {}

    def _switch(self, tp: int) -> None:
        old, new = self.layout, Layout.for_world(self.layout.world, tp)
        order: list[int] = []  # unfinished, in status order (group by group, running then waiting)
        for g in self.groups:
            for i in g.running:
                self.generated[i] = self._tokens(g, i)
            order += list(g.running) + list(g.waiting)
        status = self.status()
        reqs = status.requests
        placement = self.pred.current_placement([len(g.requests) for g in status.groups])
        target = balance_by_context([r.context_len for r in reqs], new.dp)
        cost = self.pred.switch_cost(old, new, reqs, placement, target)
        migrate = cost.kv_path == "migrate"
        # recompute: the re-prefill runs as ordinary prefill steps after the switch, not inside it
        seconds = cost.weights_s + cost.fixed_s + cost.graphs_s + (cost.migrate_s if migrate else 0.0)
        self.switches.append(SwitchRecord(self.now, old.tp, tp, len(reqs), seconds, cost.kv_path,
                                          self._pending_details))
        self.now += seconds
        self.layout = new
        self.groups = [Group(steps=self.stage_step) for _ in range(new.dp)]
        for gi, idx in enumerate(target):
            grp = self.groups[gi]
            for k in sorted(idx, key=lambda k: order[k]):  # keep arrival order within a group
                i = order[k]
                if migrate and self.cached[i]:
                    self._join(grp, i)
                else:
                    self.cached[i] = False
                    grp.waiting.append(i)
        self.pending = None
        self.timeline.append((self.now, self.active, tp))

    # ---- results ---------------------------------------------------------------------------------------

    @property
    def finished_at(self) -> float:
        return float(np.nanmax(self.done_at))

    def copy(self) -> "Simulation":
        """An independent copy of the run's state (predictor and policy shared)."""
        out = copy.copy(self)
        out.generated, out.done_at, out.cached = self.generated.copy(), self.done_at.copy(), self.cached.copy()
        out.groups = [Group(dict(g.running), list(g.finish), deque(g.waiting), g.steps, g.base, g.busy_until,
                            g.inflight) for g in self.groups]
        out.switches, out.timeline = list(self.switches), list(self.timeline)
        return out

    def finish_estimate(self) -> float:
        """Completion time with no further switches, from the drain integral (fast; for searches).

        Runs the pending switch (if any) step by step first, then drains every group analytically.
        """
        sim = self.copy()
        sim.policy = None
        while sim.pending is not None:
            if sim.run(stop_at_checks=True):
                return sim.finished_at
        ends = []
        for g in sim.groups:
            t = g.busy_until if g.inflight is not None else sim.now
            running = list(g.running)
            if g.inflight is not None and g.inflight[0] == "prefill":
                running += g.inflight[1]  # their token from the prefill comes with the step
            tokens = [sim._tokens(g, i) if i in g.running else int(sim.generated[i]) + 1 for i in running]
            if g.inflight is not None and g.inflight[0] == "decode":
                tokens = [n + 1 for n in tokens]  # the step in flight adds one token each
            cold = list(g.waiting)
            room = max(self.max_num_seqs - len(running), 0)
            first, later = cold[:room], cold[room:]
            if first:
                t += self.pred.prefill_seconds(sim.layout.tp, len(first),
                                               rms_context([int(sim.prompt[i] + sim.generated[i]) for i in first]))
                tokens += [int(sim.generated[i]) + 1 for i in first]
                running += first
            ids = running + later
            tok = np.array(tokens + [int(sim.generated[i]) for i in later])
            rem = np.maximum(self.target[ids] - tok, 0)
            rem[len(running):] = np.maximum(rem[len(running):], 1)
            ctx = self.prompt[ids] + tok
            admit = np.zeros(len(ids))
            admit[len(running):] = [self.pred.prefill_seconds(sim.layout.tp, 1, c) for c in ctx[len(running):]]
            t += float(drain_seconds(lambda b, c: self.pred.step_seconds(sim.layout.tp, b, c), ctx[None],
                                     rem[None], self.max_num_seqs, admit[None])[0])
            ends.append(t)
        done = np.nanmax(sim.done_at) if np.isfinite(sim.done_at).any() else 0.0
        return max(ends + [done])
