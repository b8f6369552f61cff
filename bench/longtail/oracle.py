"""Hindsight oracle: the best switch schedule for a batch whose every length is known.

Search space: static layouts, and schedules of up to two switches issued at
policy checks (every ``check_interval`` decode steps, as a policy could),
starting from the base layout; a second switch only goes to a layout that
runs a single request faster than the first target (the batch only shrinks).
These restrictions are ours, so a policy can in principle beat the "oracle"
(e.g. with three switches). Candidates are scored fast (step-exact replay
up to the last switch, the drain integral after it); the best few are then
replayed step by step with the engine's ``ScheduledSwitches`` policy and the
best replay is the oracle. First switch points are searched on a coarse grid
of checks and refined around the best at every check; second switches on the
coarse grid after the first, then refined the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pat_engine.predictor.policy import ScheduledSwitches
from longtail.simulator import Simulation


@dataclass(frozen=True)
class OracleResult:
    seconds: float
    start_tp: int  # the base layout, or the best static layout when no schedule beats it
    schedule: tuple[tuple[int, int], ...]  # (stage decode step, tp)
    sim: Simulation
    static: dict[int, float]
    evaluated: int


def _checkpoints(sim: Simulation, every: int, first: int = 0, last: int | None = None) -> list[Simulation]:
    """Copies of the run at every ``every``-th policy check (after ``first`` and up to ``last`` stage steps)."""
    out, n = [], 0
    sim = sim.copy()
    while not sim.run(stop_at_checks=True):
        if sim.stage_step <= first:
            continue
        if last is not None and sim.stage_step > last:
            break
        if n % every == 0:
            out.append(sim.copy())
        n += 1
    return out


def _score(snap: Simulation, tp: int) -> float:
    pending, snap.pending = snap.pending, None
    snap.request_switch(tp)
    try:
        return snap.finish_estimate()  # works on a copy
    finally:
        snap.pending = pending


def search(make: Callable[[int], Simulation], base_tp: int, tps: list[int], coarse: int = 16,
           top: int = 4) -> OracleResult:
    """``make(tp)``: a fresh simulation of the batch starting at ``tp`` with no policy."""
    static = {}
    for tp in tps:
        s = make(tp)
        s.run()
        static[tp] = s.finished_at
    k = make(base_tp).k
    scored: dict[tuple[tuple[int, int], ...], float] = {}

    def add(schedule, seconds):
        scored[schedule] = min(seconds, scored.get(schedule, float("inf")))

    base = make(base_tp)
    # one switch: coarse grid of checks, then every check around the best
    coarse_snaps = _checkpoints(base, coarse)
    for snap in coarse_snaps:
        for tp in tps:
            if tp != base_tp:
                add(((snap.stage_step, tp),), _score(snap, tp))
    best1 = sorted((s for s in scored if len(s) == 1), key=scored.get)[:2]
    for (step, tp), in best1:
        for snap in _checkpoints(base, 1, step - coarse * k, step + coarse * k):
            add(((snap.stage_step, tp),), _score(snap, tp))
    # two switches: after each coarse first switch, a coarse grid of second switches
    pred = base.pred
    solo = {tp: pred.decode.scalar(tp, 1, float(base.cap)) for tp in tps}
    onward = {tp: [t for t in tps if solo[t] < solo[tp]] for tp in tps}
    firsts = [(snap, tp) for snap in coarse_snaps for tp in tps if tp != base_tp and onward[tp]]
    for snap, tp1 in firsts:
        after = snap.copy()
        after.request_switch(tp1)
        for snap2 in _checkpoints(after, max(coarse // 2, 1), first=snap.stage_step):
            for tp2 in onward[tp1]:
                add(((snap.stage_step, tp1), (snap2.stage_step, tp2)), _score(snap2, tp2))
    # refine the best two-switch schedules: second point at every check near it, then the first
    for sched in sorted((s for s in scored if len(s) == 2), key=scored.get)[:2]:
        (s1, tp1), (s2, tp2) = sched
        first = next(c for c in _checkpoints(base, 1, s1 - 1, s1))
        first.request_switch(tp1)
        for snap2 in _checkpoints(first, 1, max(s1, s2 - coarse * k), s2 + coarse * k):
            add(((s1, tp1), (snap2.stage_step, tp2)), _score(snap2, tp2))
    # replay the best candidates exactly
    best_static_tp = min(static, key=static.get)
    best, best_sched, best_sim, start = static[best_static_tp], (), None, best_static_tp
    for sched in sorted(scored, key=scored.get)[:top]:
        sim = make(base_tp)
        sim.policy = ScheduledSwitches(list(sched))
        sim.run()
        if sim.finished_at < best:
            best, best_sched, best_sim, start = sim.finished_at, sched, sim, base_tp
    if best_sim is None:
        best_sim = make(best_static_tp)
        best_sim.run()
    return OracleResult(best, start, best_sched, best_sim, static, len(scored))
