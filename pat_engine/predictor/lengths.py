"""Remaining-length estimators: the paper's bound and an empirical length distribution.

``MaxLengthBound`` (paper, Alg. 1): every unfinished request runs to its
``max_new_tokens``. It can never under-estimate, so it never regrets a
switch for lack of work, but it overstates the tail.

``LengthDistribution``: response lengths are drawn from a Kaplan-Meier
estimate of the survival function S(l) = P(length > l), pooled over complete
earlier stages (and an optional prior sample with a pseudo-weight) plus the
current stage, where finished requests are events and unfinished ones are
right-censored at their current length. A request that has generated g tokens
draws its final length from S(l)/S(g) for l > g; the mass S has left beyond the
last observed event goes to the request's cap. With no data that is exactly
the paper's bound, so the estimator degrades gracefully on a cold start.

Draws use common random numbers: the same uniform per (draw, request) for
every candidate layout, so layouts are compared on the same futures.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from pat_engine.predictor.policy import RequestSnapshot


class RemainingEstimator(Protocol):
    name: str

    def draws(self, reqs: Sequence[RequestSnapshot], rng: np.random.Generator) -> np.ndarray:
        """(draws, len(reqs)) tokens each request still generates, >= 1."""
        ...


def _left(reqs: Sequence[RequestSnapshot]) -> np.ndarray:
    return np.array([max(1, r.max_new_tokens - r.generated) for r in reqs], np.int64)


class MaxLengthBound:
    name = "max-length bound"

    def draws(self, reqs: Sequence[RequestSnapshot], rng: np.random.Generator) -> np.ndarray:
        return _left(reqs)[None, :]


@dataclass(frozen=True)
class Survival:
    """Kaplan-Meier step function: S(times[j]) = surv[j], S = 1 before times[0]."""

    times: np.ndarray  # distinct event lengths, ascending
    surv: np.ndarray  # S just after each event time, non-increasing

    def at(self, g: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(self.times, g, side="right") - 1
        return np.where(idx >= 0, self.surv[np.maximum(idx, 0)], 1.0)


def kaplan_meier(events: np.ndarray, censored: np.ndarray, event_w: np.ndarray | None = None,
                 censored_w: np.ndarray | None = None) -> Survival:
    """Weighted Kaplan-Meier estimate; a censored value c means length > c."""
    events = np.asarray(events, float)
    censored = np.asarray(censored, float)
    ew = np.ones(len(events)) if event_w is None else np.asarray(event_w, float)
    cw = np.ones(len(censored)) if censored_w is None else np.asarray(censored_w, float)
    if len(events) == 0:
        return Survival(np.zeros(0), np.zeros(0))
    times, inv = np.unique(events, return_inverse=True)
    deaths = np.bincount(inv, weights=ew, minlength=len(times))
    # at risk at t: every observation with value >= t (events) or > t (censored beyond t)
    ev_sorted = np.sort(events)
    ev_w_sorted = ew[np.argsort(events, kind="stable")]
    ev_tail = np.concatenate([np.cumsum(ev_w_sorted[::-1])[::-1], [0.0]])
    at_risk = ev_tail[np.searchsorted(ev_sorted, times, side="left")]
    if len(censored):
        c_order = np.argsort(censored, kind="stable")
        c_sorted, c_w = censored[c_order], cw[c_order]
        c_tail = np.concatenate([np.cumsum(c_w[::-1])[::-1], [0.0]])
        at_risk = at_risk + c_tail[np.searchsorted(c_sorted, times, side="left")]
    surv = np.cumprod(1.0 - deaths / np.maximum(at_risk, 1e-12))
    return Survival(times, np.clip(surv, 0.0, 1.0))


class LengthDistribution:
    """Empirical length distribution learned from earlier stages (plus an optional prior) and the current one."""

    name = "length distribution"

    def __init__(self, draws: int = 16, max_stages: int = 4, prior: np.ndarray | None = None,
                 prior_weight: float = 1.0):
        self.num_draws = draws
        self.stages: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=max_stages)  # (lengths, capped)
        self.prior = None if prior is None else np.asarray(prior, float)
        self.prior_weight = prior_weight  # weight of each prior sample relative to one observed request
        self.current_events = np.zeros(0)  # finished this stage
        self.current_capped = np.zeros(0)  # finished at their cap this stage (censored at the cap)

    # ---- learning ----------------------------------------------------------------------------

    def add_stage(self, lengths: Sequence[int], capped: Sequence[bool] | None = None) -> None:
        """Record a complete earlier stage: response lengths, and which stopped at their cap (censored)."""
        lengths = np.asarray(lengths, float)
        capped = np.zeros(len(lengths), bool) if capped is None else np.asarray(capped, bool)
        self.stages.append((lengths, capped))

    def set_current(self, finished: Sequence[int], finished_capped: Sequence[bool]) -> None:
        fin = np.asarray(finished, float)
        cap = np.asarray(finished_capped, bool)
        self.current_events, self.current_capped = fin[~cap], fin[cap]

    def survival(self, unfinished_generated: np.ndarray) -> Survival:
        ev, ce = [self.current_events], [self.current_capped, unfinished_generated]
        ew = [np.ones(len(self.current_events))]
        cw = [np.ones(len(self.current_capped)), np.ones(len(unfinished_generated))]
        for lengths, capped in self.stages:
            ev.append(lengths[~capped]); ew.append(np.ones((~capped).sum()))
            ce.append(lengths[capped]); cw.append(np.ones(capped.sum()))
        if self.prior is not None:
            ev.append(self.prior); ew.append(np.full(len(self.prior), self.prior_weight))
        return kaplan_meier(np.concatenate(ev), np.concatenate(ce), np.concatenate(ew), np.concatenate(cw))

    # ---- drawing -----------------------------------------------------------------------------

    def draws(self, reqs: Sequence[RequestSnapshot], rng: np.random.Generator) -> np.ndarray:
        g = np.array([r.generated for r in reqs], float)
        cap = np.array([r.max_new_tokens for r in reqs], float)
        left = _left(reqs)
        s = self.survival(g)
        if len(s.times) == 0:
            return left[None, :]
        u = rng.random((self.num_draws, len(reqs)))
        # final length: first event time l > g with S(l) <= S(g) * (1 - u); none -> the cap
        level = s.at(g)[None, :] * (1.0 - u)  # (D, n)
        neg = -s.surv  # ascending, for searchsorted
        idx = np.searchsorted(neg, -level, side="left")  # first j with surv[j] <= level
        # the chosen event must lie beyond g (S is flat up to g, so idx already is; guard ties)
        length = np.where(idx < len(s.times), s.times[np.minimum(idx, len(s.times) - 1)], np.inf)
        length = np.minimum(np.maximum(length, g[None, :] + 1), cap[None, :])
        return np.clip(length - g[None, :], 1, left[None, :]).astype(np.int64)


class SnapshotLengthTracker:
    """Infers finished requests' lengths from the coordinator's periodic status snapshots.

    The policy hook sees unfinished requests only. Between two snapshots Δ decode steps apart,
    requests that vanished finished after generating between g and g+Δ tokens (g at the earlier
    snapshot); we record g + Δ/2, or the cap if they reached it. Survivors are matched to the
    earlier snapshot by (prompt length, cap) and generated count. A reset of the stage step
    counter starts a new stage; the old stage's last survivors ended within one check interval.
    """

    def __init__(self, dist: LengthDistribution, interval: int):
        self.dist = dist
        self.interval = interval
        self.prev: list[RequestSnapshot] | None = None
        self.prev_step = 0
        self.finished: list[int] = []
        self.finished_capped: list[bool] = []

    def update(self, reqs: Sequence[RequestSnapshot], stage_step: int) -> None:
        if self.prev is not None and stage_step < self.prev_step:
            self._close_stage()
            self.prev = None
        if self.prev is not None:
            delta = max(stage_step - self.prev_step, 0)
            for r in _vanished(self.prev, reqs):
                self._finish(r, r.generated + delta / 2)
        self.prev, self.prev_step = list(reqs), stage_step
        self.dist.set_current(self.finished, self.finished_capped)

    def _finish(self, r: RequestSnapshot, length: float) -> None:
        length = min(length, r.max_new_tokens)
        self.finished.append(int(round(length)))
        self.finished_capped.append(length >= r.max_new_tokens)

    def _close_stage(self) -> None:
        for r in self.prev or []:
            self._finish(r, r.generated + self.interval / 2)
        if self.finished:
            self.dist.add_stage(self.finished, self.finished_capped)
        self.finished, self.finished_capped = [], []
        self.dist.set_current([], [])


def _vanished(prev: Sequence[RequestSnapshot], now: Sequence[RequestSnapshot]) -> list[RequestSnapshot]:
    """Requests of ``prev`` with no match in ``now`` (same prompt length and cap, not fewer tokens)."""
    by_key: dict[tuple[int, int], list[int]] = {}
    for r in now:
        by_key.setdefault((r.prompt_len, r.max_new_tokens), []).append(r.generated)
    gone = []
    for key in {(r.prompt_len, r.max_new_tokens) for r in prev}:
        before = sorted((r for r in prev if (r.prompt_len, r.max_new_tokens) == key), key=lambda r: -r.generated)
        after = sorted(by_key.get(key, []), reverse=True)
        # greedy: each survivor (most advanced first) claims the most advanced request it can have come from
        j = 0
        used = [False] * len(before)
        for g in after:
            while j < len(before) and (used[j] or before[j].generated > g):
                j += 1
            if j < len(before):
                used[j] = True
                j += 1
        gone.extend(r for r, u in zip(before, used) if not u)
    return gone
