"""Switch now, or later? Predicted totals of small switch plans, per draw of the remaining lengths.

Algorithm 1 compares switching now with staying for good, so once another TP
beats the current layout *for the rest of the stage* it switches at once,
even when waiting until the batch has shrunk would be better still (TP8 can
beat TP2 from the first step in total while TP2-then-TP8 beats both). With a
length distribution we can see the batch shrink, so the controller also
prices, for every draw (arrays are (draws, requests); rem == 0: finished):

  deferred(src -> X at s):  src's groups decode min(rem, s) steps (slowest
      group), then the switch (cost for the survivors, contexts grown by s),
      then the survivors drain under X;
  value(src -> X now):  the switch, then the best of staying on X and
      deferred(X -> Y at s) for every later Y (one more switch);
  the same value one or a few check intervals later (after src decodes d
      steps), to see whether this very switch pays more if made later.

After a (planned) switch the survivors are spread over the target's groups
round robin from the longest context: the engine's balancing when contexts
are close, vectorisable over draws, and stable across deferrals. Deferral points s are k, 2k, 4k, ...
Under the max-length bound nobody finishes before the cap, so deferring never
looks better and none of this changes the paper's rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pat_engine.parallel.layout import Layout
from pat_engine.predictor.drain import drain_seconds


@dataclass(frozen=True)
class Future:
    ctx: np.ndarray  # (n,) context length now
    cached: np.ndarray  # (n,) has KV
    rem: np.ndarray  # (D, n) tokens still to generate in each draw; 0 = finished

    def after(self, d: int) -> "Future":
        return Future(self.ctx + d, self.cached, np.maximum(self.rem - d, 0))


def deferral_steps(rem: np.ndarray, first: int) -> list[int]:
    top = int(rem.max()) if rem.size else 0
    out, s = [], max(first, 1)
    while s < top:
        out.append(s)
        s *= 2
    return out


def round_robin(ctx: np.ndarray, alive: np.ndarray, dp: int) -> np.ndarray:
    """(..., n) group of each alive request (-1 otherwise): longest context first, round robin.

    Ranks count every request, finished or not, so a request keeps its group whichever draw or
    deferral we look at: comparisons see the delay, not a reshuffle of where the long ones land
    (which alone moves a draw's drain time by several percent)."""
    rank = np.empty(len(ctx), np.int64)
    rank[np.argsort(-ctx, kind="stable")] = np.arange(len(ctx))
    return np.where(alive, rank % dp, -1)


def drain_groups(pred, layout: Layout, groups: np.ndarray, ctx: np.ndarray, rem: np.ndarray) -> np.ndarray:
    """(...) seconds for the slowest group; groups, rem: (..., n); ctx broadcastable to them."""
    lead = rem.shape[:-1]
    g = np.where(rem > 0, groups, -1).reshape(-1, rem.shape[-1])
    r = rem.reshape(-1, rem.shape[-1])
    c = np.broadcast_to(ctx, rem.shape).reshape(-1, rem.shape[-1])
    lanes = g.shape[0]
    onehot = g[:, None, :] == np.arange(layout.dp)[None, :, None]  # (L, dp, n)
    pos = np.cumsum(onehot, axis=2) - 1
    width = max(int(onehot.sum(axis=2).max()), 1)
    lane_ctx = np.zeros((lanes, layout.dp, width))
    lane_rem = np.zeros((lanes, layout.dp, width), np.int64)
    li, gi, ni = np.nonzero(onehot)
    pi = pos[li, gi, ni]
    lane_ctx[li, gi, pi] = c[li, ni]
    lane_rem[li, gi, pi] = r[li, ni]
    secs = drain_seconds(pred.step_fn(layout), lane_ctx.reshape(-1, width),
                         lane_rem.reshape(-1, width), pred.max_num_seqs)
    return secs.reshape(lanes, layout.dp).max(axis=1).reshape(lead)


def switch_seconds(pred, src: Layout, src_groups: np.ndarray, dst: Layout, fut: Future) -> np.ndarray:
    """(...) weights + fixed + graphs + min(migrate, recompute) for the requests still running (rem > 0)."""
    live = (fut.rem > 0) & fut.cached
    grown = np.where(live, fut.ctx, 0.0)  # (..., n)
    bw = max(pred.bandwidth(), 1.0)
    per_src = np.stack([np.where(src_groups == g, grown, 0.0).sum(axis=-1) for g in range(src.dp)], axis=-1)
    migrate = per_src.max(axis=-1) * pred.table.model.kv_bytes_per_token_per_rank(src.tp) / bw
    n = live.sum(axis=-1)
    rms = np.sqrt((grown**2).sum(axis=-1) / np.maximum(n, 1))
    recompute = pred.prefill(dst.tp, np.maximum(np.ceil(n / dst.dp), 1), rms)
    fixed = pred.weight_seconds(src.tp, dst.tp, bw) + pred.fixed_seconds(src.tp, dst.tp)
    fixed = fixed + pred.graph_seconds(src.tp, dst.tp, np.ceil((fut.rem > 0).sum(axis=-1) / dst.dp))
    return np.where((fut.rem > 0).any(axis=-1), fixed + np.minimum(migrate, recompute), 0.0)


def deferred(pred, fut: Future, src: Layout, src_groups: np.ndarray, dst: Layout, steps: list[int]) -> np.ndarray:
    """(m, D) total time of "stay on src for s steps, then switch to dst" for each s in ``steps``;
    (0, D) when there is none (every request ends before the first deferral)."""
    if not steps:
        return np.zeros((0, *fut.rem.shape[:-1]))
    s = np.array(steps)[:, None, None]  # (m, 1, 1)
    reach = drain_groups(pred, src, np.broadcast_to(src_groups, (len(steps),) + fut.rem.shape),
                         fut.ctx, np.minimum(fut.rem[None], s))
    later = Future(fut.ctx[None, None, :] + s, fut.cached, np.maximum(fut.rem[None] - s, 0))
    cost = switch_seconds(pred, src, src_groups[None], dst, later)
    alive = later.rem > 0
    # the longest-first order does not depend on s (every context grows by s)
    drain = drain_groups(pred, dst, round_robin(fut.ctx, alive, dst.dp), later.ctx, later.rem)
    return reach + cost + drain


def switch_value(pred, fut: Future, src: Layout, src_groups: np.ndarray, dst: Layout, onward: list[Layout],
                 steps: list[int]) -> np.ndarray:
    """(D,) switch to dst now, then stay there or move on to one of ``onward`` later.

    The continuation is the one with the best mean over draws (not the best per draw, which would
    assume we knew each draw's lengths)."""
    groups = round_robin(fut.ctx, fut.rem > 0, dst.dp)
    rows = [drain_groups(pred, dst, groups, fut.ctx, fut.rem)[None]]
    rows += [deferred(pred, fut, dst, groups, nxt, steps) for nxt in onward]
    rows = np.concatenate(rows)  # (plans, D)
    return switch_seconds(pred, src, src_groups, dst, fut) + rows[rows.mean(axis=1).argmin()]
