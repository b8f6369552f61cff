"""How long a DP group takes to drain its requests, given how many tokens each still has to generate.

A *lane* is one group under one draw of the remaining lengths. Each step every
active request generates one token, so between two finishes the batch size b
is fixed and the total context grows by b per step: the step latency is
``f(b, A + b*t)``. A segment of n steps is integrated with Simpson's rule on
its first, middle and last step (exact while f is linear in the context,
close when a fit knot falls inside), so the cost is O(requests), not O(steps).

When a group holds more requests than ``max_seqs`` the rest wait and start as
slots free up (FIFO, list scheduling); those lanes take a slower per-lane path.
"""

from __future__ import annotations

import heapq
from typing import Callable

import numpy as np

StepFn = Callable[[np.ndarray, np.ndarray], np.ndarray]  # f(batch, total context) -> seconds, elementwise


def _simpson(step: StepFn, batch: np.ndarray, base: np.ndarray, t0: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Sum over t in [t0, t0+n) of step(batch, base + batch*t); entries with n == 0 give 0."""
    live = n > 0
    out = np.zeros(n.shape)
    if not live.any():
        return out
    b, a, t, m = batch[live], base[live], t0[live], n[live]
    last = t + m - 1
    mid = t + (m - 1) / 2
    # the three points in one call of the (elementwise) step function: a third of its fixed cost
    f0, fm, f1 = np.split(step(np.tile(b, 3), np.concatenate([a + b * t, a + b * mid, a + b * last])), 3)
    out[live] = m * (f0 + 4 * fm + f1) / 6
    return out


def drain_seconds(step: StepFn, ctx: np.ndarray, rem: np.ndarray, max_seqs: int,
                  admit_s: np.ndarray | None = None) -> np.ndarray:
    """Seconds until every lane's requests are done.

    ctx, rem: (lanes, n) current context length and tokens still to generate (rem == 0: no request;
    pad lanes with zeros). admit_s: (lanes, n) extra seconds when a request is admitted late (its prefill).
    Returns (lanes,).
    """
    ctx = np.asarray(ctx, float)
    rem = np.asarray(rem, np.int64)
    if ctx.ndim == 1:
        ctx, rem = ctx[None], rem[None]
    counts = (rem > 0).sum(axis=1)
    out = np.zeros(len(rem))
    fast = counts <= max_seqs
    if fast.any():
        out[fast] = _drain_all_running(step, ctx[fast], rem[fast])
    for lane in np.flatnonzero(~fast):
        extra = None if admit_s is None else admit_s[lane]
        out[lane] = _drain_with_queue(step, ctx[lane], rem[lane], max_seqs, extra)
    return out


def _drain_all_running(step: StepFn, ctx: np.ndarray, rem: np.ndarray) -> np.ndarray:
    order = np.argsort(rem, axis=1, kind="stable")
    lanes = np.arange(len(rem))[:, None]
    r = rem[lanes, order]  # (L, n) ascending; padding (0) first
    c = ctx[lanes, order] * (r > 0)
    n = r.shape[1]
    prev = np.concatenate([np.zeros((len(r), 1), np.int64), r[:, :-1]], axis=1)
    length = r - prev  # steps in segment k: from r_(k-1) to r_(k)
    batch = (n - np.arange(n))[None, :].repeat(len(r), 0)  # positions >= k are still running
    base = np.cumsum(c[:, ::-1], axis=1)[:, ::-1]  # sum of contexts of positions >= k
    secs = _simpson(step, batch.ravel().astype(float), base.ravel(), prev.ravel().astype(float),
                    length.ravel())
    return secs.reshape(r.shape).sum(axis=1)


def _drain_with_queue(step: StepFn, ctx: np.ndarray, rem: np.ndarray, max_seqs: int,
                      admit_s: np.ndarray | None) -> float:
    keep = rem > 0
    ctx, rem = ctx[keep], rem[keep]
    extra = 0.0 if admit_s is None else float(admit_s[keep][max_seqs:].sum())
    # FIFO list scheduling: request i starts when the earliest running one ends
    start = np.zeros(len(rem), np.int64)
    ends = [int(r) for r in rem[:max_seqs]]
    heapq.heapify(ends)
    for i in range(max_seqs, len(rem)):
        s = heapq.heappop(ends)
        start[i] = s
        heapq.heappush(ends, s + int(rem[i]))
    end = start + rem
    # batch and (context - step * batch) change only at starts and ends
    times = np.concatenate([start, end])
    d_batch = np.concatenate([np.ones(len(rem)), -np.ones(len(rem))])
    d_base = np.concatenate([ctx - start, -(ctx - start)])
    order = np.argsort(times, kind="stable")
    times, d_batch, d_base = times[order], d_batch[order], d_base[order]
    uniq, first = np.unique(times, return_index=True)
    batch = np.add.reduceat(d_batch, first).cumsum()
    base = np.add.reduceat(d_base, first).cumsum()
    length = np.diff(uniq)
    secs = _simpson(step, batch[:-1], base[:-1], uniq[:-1].astype(float), length)
    return float(secs.sum()) + extra
