"""Piecewise-linear latency fits over a sparse profile (paper Sec. 4.2, "Online Latency Predictor").

Per (tp, batch size) a curve of latency against one x (total context tokens
for decode steps, per-request context length for prefill): knots at the
profiled points (np.interp between them); beyond the ends, a straight line
from the end knot with the least-squares slope of the whole curve (clamped at
>= 0), so one noisy end point cannot swing the extrapolation. Between
profiled batch sizes the two nearest curves are evaluated at the same x and
interpolated linearly in batch size; beyond the largest profiled batch the
two largest are extrapolated linearly.

Everything is vectorised: ``tp`` is a scalar, ``batch`` and ``x`` broadcast.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from typing import Iterable

import numpy as np

from pat_engine.predictor.table import ProfilePoint


class LatencyCurve:
    """y(x): piecewise linear through the knots, linear beyond them."""

    def __init__(self, x: Iterable[float], y: Iterable[float]):
        x, y = np.asarray(list(x), float), np.asarray(list(y), float)
        order = np.argsort(x)
        x, y = x[order], y[order]
        ux = np.unique(x)  # repeated measurements at one x: average them
        self.y = np.array([y[x == v].mean() for v in ux])
        self.x = ux
        if len(self.x) >= 2:
            slope = np.polyfit(self.x, self.y, 1)[0]
        else:
            slope = 0.0
        self.slope = max(float(slope), 0.0)

        self._xs, self._ys = self.x.tolist(), self.y.tolist()  # for the scalar path

    def scalar(self, x: float) -> float:
        """Same as __call__ for one float, without numpy's per-call overhead (simulators call it a lot)."""
        xs, ys = self._xs, self._ys
        if x <= xs[0]:
            return ys[0] + self.slope * (x - xs[0])
        if x >= xs[-1]:
            return ys[-1] + self.slope * (x - xs[-1])
        j = bisect_right(xs, x)
        w = (x - xs[j - 1]) / (xs[j] - xs[j - 1])
        return ys[j - 1] + w * (ys[j] - ys[j - 1])

    def __call__(self, x) -> np.ndarray:
        x = np.asarray(x, float)
        out = np.asarray(np.interp(x, self.x, self.y))
        # the ends' lines only where x lies beyond them (the controller calls this thousands of times a
        # stage on small arrays: whole-array selects cost more than the interpolation)
        for beyond, x_end, y_end in ((x < self.x[0], self.x[0], self.y[0]), (x > self.x[-1], self.x[-1], self.y[-1])):
            if beyond.any():
                out[beyond] = y_end + self.slope * (x[beyond] - x_end)
        return out


class BatchInterpolated:
    """f(tp, batch, x) from per-(tp, batch) curves."""

    def __init__(self, curves: dict[int, dict[int, LatencyCurve]]):
        if not curves:
            raise ValueError("no profile points to fit")
        self.curves = curves
        self.batches = {tp: np.array(sorted(c)) for tp, c in curves.items()}
        self._sizes = {tp: sorted(c) for tp, c in curves.items()}

    @property
    def tps(self) -> list[int]:
        return sorted(self.curves)

    def scalar(self, tp: int, batch: float, x: float) -> float:
        """``self(tp, batch, x)`` for scalars."""
        if batch <= 0:
            return 0.0
        sizes = self._sizes[tp]
        curves = self.curves[tp]
        if len(sizes) == 1:
            return max(curves[sizes[0]].scalar(x), 0.0)
        hi = min(max(bisect_left(sizes, batch), 1), len(sizes) - 1)
        b_lo, b_hi = sizes[hi - 1], sizes[hi]
        w = max((batch - b_lo) / (b_hi - b_lo), 0.0)
        return max((1 - w) * curves[b_lo].scalar(x) + w * curves[b_hi].scalar(x), 0.0)

    def __call__(self, tp: int, batch, x) -> np.ndarray:
        if tp not in self.curves:
            raise KeyError(f"the profile has no points for tp={tp} (has {self.tps})")
        batch = np.asarray(batch, float)
        x = np.asarray(x, float)
        if batch.shape != x.shape:
            batch, x = np.broadcast_arrays(batch, x)
        sizes = self.batches[tp]
        curves = self.curves[tp]
        if len(sizes) == 1:
            return np.where(batch > 0, curves[int(sizes[0])](x), 0.0)
        # index of the lower bracketing profiled batch; the top pair extrapolates beyond the largest
        hi = np.minimum(np.maximum(np.searchsorted(sizes, batch, side="left"), 1), len(sizes) - 1)
        lo = hi - 1
        b_lo, b_hi = sizes[lo], sizes[hi]
        w = (batch - b_lo) / (b_hi - b_lo)
        w = np.maximum(w, 0.0)  # below the smallest profiled batch: use it (no extrapolation down)
        pairs = np.flatnonzero(np.bincount(lo.ravel(), minlength=len(sizes)))
        if len(pairs) == 1:  # one pair for every element (the usual case): no selection
            i = int(pairs[0])
            out = (1 - w) * curves[int(sizes[i])](x) + w * curves[int(sizes[i + 1])](x)
        else:
            out = np.zeros(batch.shape)
            for i in pairs:  # few distinct pairs: evaluate each pair's curves once
                sel = lo == i
                f_lo = curves[int(sizes[i])](x[sel])
                f_hi = curves[int(sizes[i + 1])](x[sel])
                out[sel] = (1 - w[sel]) * f_lo + w[sel] * f_hi
        return np.where(batch > 0, np.maximum(out, 0.0), 0.0)


def _fit(points: Iterable[ProfilePoint], x_of, y_of) -> BatchInterpolated:
    grouped: dict[int, dict[int, list[ProfilePoint]]] = defaultdict(lambda: defaultdict(list))
    for p in points:
        grouped[p.tp][p.batch_size].append(p)
    curves = {
        tp: {b: LatencyCurve([x_of(p) for p in pts], [y_of(p) for p in pts]) for b, pts in by_batch.items()}
        for tp, by_batch in grouped.items()
    }
    return BatchInterpolated(curves)


def fit_decode(points: Iterable[ProfilePoint]) -> BatchInterpolated:
    """Decode step seconds as f(tp, batch per group, total context tokens of the group)."""
    return _fit(points, lambda p: p.total_tokens, lambda p: p.decode_step_s)


def fit_prefill(points: Iterable[ProfilePoint]) -> BatchInterpolated:
    """Prefill seconds of one group as f(tp, requests, context length of each)."""
    return _fit(points, lambda p: p.context_len, lambda p: p.prefill_s)
