"""How many draft tokens each request of a verify step gets: expected tokens per second, maximised.

A draft of ``k`` tokens whose tokens are each accepted with probability ``p`` (given the ones
before were) yields ``1 + p + p^2 + ... + p^k`` tokens in expectation: extending it from ``k``
to ``k + 1`` tokens gains ``p^(k+1)``. A step running ``R`` tokens costs about
``fixed + per_token * R`` seconds (``StepCostFit``, fitted to the steps the engine ran). Adding
one draft token pays when its gain per extra second beats the step's tokens per second so far:
``gain * T(R) > expected * per_token``. Gains only fall as drafts grow, so taking the best gain
first (over every request) until one does not pay maximises the step's expected tokens per
second. Where verifying costs almost nothing per token (a memory-bound GPU step) every draft
runs whole; where it costs a lot (small CPU GEMMs are compute-bound) only likely tokens are
verified.

``AcceptanceEstimate`` is ``p`` per request: its own accepted / tried draft tokens shrunk
toward the engine-wide rate, with every count forgotten a little at each step, so a request
whose drafts stopped being tried drifts back to the engine-wide rate and is tried again.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

_FORGET = 0.95  # per step: counts and fitted sums shrink by this factor


@dataclass
class StepCostFit:
    """seconds ~= fixed + per_token * tokens, least squares over recent steps (older ones forgotten)."""

    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weight, x, y, xx, xy

    def add(self, tokens: int, seconds: float) -> None:
        x, y = float(tokens), float(seconds)
        self._sums = [_FORGET * s + t for s, t in zip(self._sums, (1.0, x, y, x * x, x * y))]

    def reset(self) -> None:
        self._sums = [0.0] * 5

    def params(self) -> tuple[float, float] | None:
        """(fixed, per_token) seconds, or None until steps of different sizes were seen."""
        w, x, y, xx, xy = self._sums
        if w < 2.0:
            return None
        mx, my = x / w, y / w
        var = xx / w - mx * mx
        if var < 0.25:  # every step ran (almost) the same number of tokens: the slope is unknown
            return None
        per_token = max((xy / w - mx * my) / var, 0.0)
        return max(my - per_token * mx, 1e-6), per_token


@dataclass
class AcceptanceEstimate:
    """Per-token acceptance probability per request, shrunk toward the engine-wide rate."""

    prior_weight: float = 2.0
    _global: list[float] = field(default_factory=lambda: [1.0, 2.0])  # accepted, tried (a 0.5 prior)
    _mine: dict[int, list[float]] = field(default_factory=dict)

    def p(self, seq_id: int) -> float:
        g = self._global[0] / self._global[1]
        a, t = self._mine.get(seq_id, (0.0, 0.0))
        return (a + self.prior_weight * g) / (t + self.prior_weight)

    def add(self, seq_id: int, drafted: int, accepted: int) -> None:
        """A verify row: ``accepted`` of ``drafted`` tokens; the first rejected one is a failed try."""
        tried = accepted + (accepted < drafted)
        mine = self._mine.setdefault(seq_id, [0.0, 0.0])
        for counts in (mine, self._global):
            counts[0] += accepted
            counts[1] += tried

    def step(self) -> None:
        """Forget a little (a request not drafted for drifts back to the engine-wide rate)."""
        self._global = [1.0 + _FORGET * (self._global[0] - 1.0), 2.0 + _FORGET * (self._global[1] - 2.0)]
        for counts in self._mine.values():
            counts[0] *= _FORGET
            counts[1] *= _FORGET

    def forget(self, seq_id: int) -> None:
        self._mine.pop(seq_id, None)


def allocate(available: list[int], p: list[float], cost: tuple[float, float] | None, rows: int) -> list[int]:
    """Draft lengths for one step.

    Args:
        available: per request, how many proposed tokens it could verify (0: no proposal).
        p: per request, the per-token acceptance probability.
        cost: (fixed, per_token) step seconds, or None when unknown (then every proposal runs whole).
        rows: requests in the step (each runs its last token and yields one token at least).
    Returns:
        per request, how many of its proposed tokens to verify.
    """
    k = [0] * len(available)
    if cost is None:
        return list(available)
    fixed, per_token = cost
    expected, tokens = float(rows), rows
    heap = [(-pi, i) for i, (n, pi) in enumerate(zip(available, p)) if n > 0 and pi > 0.0]
    heapq.heapify(heap)
    while heap:
        gain, i = heapq.heappop(heap)
        gain = -gain
        if gain * (fixed + per_token * tokens) <= expected * per_token:
            break  # this token, and every later one (smaller gains), lowers the step's tokens per second
        k[i] += 1
        expected += gain
        tokens += 1
        if k[i] < available[i]:
            heapq.heappush(heap, (-gain * p[i], i))
    return k
