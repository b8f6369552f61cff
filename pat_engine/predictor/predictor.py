"""The online latency predictor (paper Sec. 4.2 and 4.3): remaining decode time and switch cost.

Remaining time of the unfinished set under a layout: place the requests on
the layout's DP groups (the current placement, or the switch's
longest-first balancing for a candidate), drain every group with the fitted
step latency (``drain.py``) for each draw of the remaining lengths, take the
slowest group (groups run in parallel) and average over draws.

Switch cost (one-time): weights = the profiled weight reshard time of that layout change (else
the busiest sender's reshard bytes / bandwidth);
KV = min(migrate, recompute) with migrate = Eq. 1-2 (busiest source group's
per-rank KV bytes / bandwidth) and recompute = Eq. 3-4 (prefill at the RMS
context length of each target group, groups in parallel); plus the fixed
costs measured by the profiler (groups, rebuild) and the decode graphs' capture: the profiled
capture time of one graph times the ladder sizes the busiest new DP group can still use (its
requests rounded up to a ladder size, and every smaller size; worker/graph_capture.py) that the
new layout did not leave set aside on an earlier visit (``MeasuredRates.graphs_left``).

Also the engine's ``CostSource`` (``cost_source.py``). Measured KV transfers
refine the bandwidth (EMA); the table's prefill fit stays authoritative. The engine's plain
decode steps correct the decode fit per TP degree and batch size (``step_calibration.py``).

Speculative decoding (docs/speculative.md): once the engine has measured verify steps,
``set_speculation`` turns them into a factor on the fitted step latency, applied to the
steps of batches small enough for speculation to run (``step_fn``): the measured seconds
per token gained, over the fitted seconds of a plain decode step of the same batch and
context. Remaining-time estimates of every candidate layout then count the tail's steps
at that speed, so a switch to a higher TP and speculation compose.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

from pat_engine.config import DEFAULT_MAX_GRAPH_BATCH, graph_ladder
from pat_engine.parallel.dp_placement import Placement
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.cost_source import CostSource
from pat_engine.predictor.drain import StepFn, drain_seconds
from pat_engine.predictor.fit import fit_decode, fit_prefill
from pat_engine.predictor.kv_path_cost import rms_context
from pat_engine.predictor.measured_rates import MeasuredRates
from pat_engine.predictor.policy import RequestSnapshot, SpeculationStatus
from pat_engine.predictor.step_calibration import CalibrationConfig, StepCalibration
from pat_engine.predictor.table import ProfileTable


@dataclass(frozen=True)
class SwitchCostEstimate:
    weights_s: float
    migrate_s: float
    recompute_s: float
    fixed_s: float
    graphs_s: float = 0.0  # capturing the decode graphs the new layout can use and did not leave set aside

    @property
    def kv_path(self) -> str:
        return "migrate" if self.migrate_s <= self.recompute_s else "recompute"

    @property
    def total_s(self) -> float:
        return self.weights_s + min(self.migrate_s, self.recompute_s) + self.fixed_s + self.graphs_s

    def to_dict(self) -> dict:
        return {**asdict(self), "kv_path": self.kv_path, "total_s": self.total_s}


class LatencyPredictor(CostSource):
    def __init__(self, table: ProfileTable, max_num_seqs: int = 256,
                 weight_bytes: Callable[[int, int], int] | None = None, bandwidth_alpha: float = 0.3,
                 graph_ladder_sizes: Sequence[int] | None = None,
                 calibration: CalibrationConfig | None = CalibrationConfig()):
        if not table.points:
            raise ValueError("the profile table has no points")
        self.table = table
        self.world = table.deployment.world
        self.max_num_seqs = max_num_seqs
        self.decode = fit_decode(table.points)
        self.prefill = fit_prefill(table.points)
        self._weight_bytes = weight_bytes  # fallback when the table lacks a pair
        self._measured = MeasuredRates(bandwidth_alpha)
        fixed = [c.fixed_s for c in table.switch_costs]
        self._default_fixed = float(np.median(fixed)) if fixed else 0.0
        # the engine's decode-graph ladder (EngineConfig.decode_graph_ladder; empty: graphs off)
        ladder = graph_ladder(min(DEFAULT_MAX_GRAPH_BATCH, max_num_seqs)) if graph_ladder_sizes is None \
            else graph_ladder_sizes
        self.graph_ladder = np.asarray(sorted(ladder), dtype=np.int64)
        self.speculation: tuple[int, float] | None = None  # (max active requests, step latency factor)
        # the fit corrected by the engine's own decode steps (None: the table as profiled, the paper's)
        self.calibration = StepCalibration(self.decode.scalar, calibration) if calibration is not None else None

    @property
    def tps(self) -> list[int]:
        return self.decode.tps

    # ---- CostSource ------------------------------------------------------------------------------

    def bandwidth(self) -> float:
        if self._measured.kv_bandwidth is not None:
            return self._measured.kv_bandwidth
        return self.table.bandwidth_bytes_per_s or MeasuredRates.DEFAULT_BANDWIDTH

    def prefill_seconds(self, tp: int, batch: int, l_rms: float) -> float:
        if batch <= 0:
            return 0.0
        if tp not in self.prefill.curves:
            return self._measured.prefill_seconds(tp, batch, l_rms)
        return float(self.prefill(tp, batch, l_rms))

    def record_kv_transfer(self, bytes_sent: int, seconds: float) -> None:
        self._measured.record_kv_transfer(bytes_sent, seconds)

    def record_prefill(self, tp: int, tokens: int, seconds: float) -> None:
        self._measured.record_prefill(tp, tokens, seconds)

    def record_weight_reshard(self, from_tp: int, to_tp: int, seconds: float) -> None:
        self._measured.record_weight_reshard(from_tp, to_tp, seconds)

    def record_graphs(self, from_tp: int, left: tuple[int, ...], to_tp: int) -> None:
        self._measured.record_graphs(from_tp, left, to_tp)

    def record_decode_step(self, tp: int, batch: int, context_tokens: int, seconds: float) -> None:
        if self.calibration is not None and tp in self.decode.curves:
            self.calibration.record(tp, batch, context_tokens, seconds)

    def forget_graphs(self) -> None:
        self._measured.forget_graphs()

    # ---- step latency -------------------------------------------------------------------------------

    def step_seconds(self, tp: int, batch, total_tokens) -> np.ndarray:
        """One group's plain decode step: the table's fit, times what the engine's steps say of it."""
        fitted = self.decode(tp, batch, total_tokens)
        return fitted if self.calibration is None else fitted * self.calibration.factor(tp, batch)

    def step_scalar(self, tp: int, batch: float, total_tokens: float) -> float:
        """``step_seconds`` for scalars, without numpy's per-call cost."""
        fitted = self.decode.scalar(tp, batch, total_tokens)
        return fitted if self.calibration is None else fitted * self.calibration.factor(tp, batch)

    def set_speculation(self, status: SpeculationStatus | None) -> None:
        """Price small batches' steps with speculative decoding's measured speed (None or unmeasured: plain).

        factor = (verify step seconds / tokens a request gains per step) / fitted plain step seconds, at
        the measured batch, context and TP; the same relative gain is assumed at every TP (clipped to
        [0.05, 4]: a factor above 1 says speculation costs more than it gains, and is priced as such)."""
        self.speculation = None
        if status is None or not status.measured or status.tp not in self.decode.tps:
            return
        plain = self.step_scalar(status.tp, max(status.batch or 1.0, 1.0), status.context_tokens or 0.0)
        if plain > 0:
            factor = (status.step_s / status.tokens_per_step) / plain
            self.speculation = (status.max_active, float(np.clip(factor, 0.05, 4.0)))

    def step_fn(self, layout: Layout) -> StepFn:
        """Seconds per decode step of one group of ``layout``, f(batch, total context), with speculation's
        factor where the engine-wide batch (``batch * dp``) is small enough for it to run."""
        tp, dp = layout.tp, layout.dp
        if self.speculation is None:
            return lambda b, c: self.step_seconds(tp, b, c)
        limit, factor = self.speculation
        return lambda b, c: self.step_seconds(tp, b, c) * np.where(np.asarray(b) * dp <= limit, factor, 1.0)

    # ---- remaining time -----------------------------------------------------------------------------

    def remaining_seconds(self, layout: Layout, reqs: Sequence[RequestSnapshot], placement: Placement,
                          rem: np.ndarray) -> np.ndarray:
        """Per draw, seconds until the slowest group is done. rem: (draws, len(reqs))."""
        rem = np.atleast_2d(rem)
        draws, width = len(rem), max((len(g) for g in placement), default=0)
        if width == 0:
            return np.zeros(draws)
        groups = len(placement)
        ctx = np.zeros((groups, width))
        rr = np.zeros((draws, groups, width), np.int64)
        admit = np.zeros((groups, width))
        start = np.zeros(groups)
        for g, idx in enumerate(placement):
            ctx[g, : len(idx)] = [reqs[i].context_len for i in idx]
            rr[:, g, : len(idx)] = rem[:, idx]
            # requests without KV here are prefilled: together now, or one by one when admitted later
            cold = [i for i in idx[: self.max_num_seqs] if not reqs[i].cached]
            start[g] = self.prefill_seconds(layout.tp, len(cold), rms_context([reqs[i].context_len for i in cold]))
            for k, i in enumerate(idx[self.max_num_seqs:], start=self.max_num_seqs):
                admit[g, k] = self.prefill_seconds(layout.tp, 1, reqs[i].context_len)
        lanes = drain_seconds(self.step_fn(layout),
                              np.broadcast_to(ctx, rr.shape).reshape(-1, width), rr.reshape(-1, width),
                              self.max_num_seqs, np.broadcast_to(admit, rr.shape).reshape(-1, width))
        return (lanes.reshape(draws, groups) + start[None, :]).max(axis=1)

    @staticmethod
    def current_placement(group_sizes: Sequence[int]) -> Placement:
        out, k = [], 0
        for n in group_sizes:
            out.append(list(range(k, k + n)))
            k += n
        return out

    # ---- switch cost ----------------------------------------------------------------------------------

    def weight_bytes(self, from_tp: int, to_tp: int) -> int:
        cost = self.table.switch_cost(from_tp, to_tp)
        if cost is not None:
            return cost.weight_bytes
        return self._weight_bytes(from_tp, to_tp) if self._weight_bytes else 0

    def weight_seconds(self, from_tp: int, to_tp: int, bandwidth: float) -> float:
        """What this engine's own switches of that kind took (EMA), else the profiled weight reshard time
        (it includes allocating and copying the new shards, which bytes / bandwidth leaves out: 5-10x more
        for a CPU merge), else bytes / bandwidth."""
        measured = self._measured.weight_reshard_s.get((from_tp, to_tp))
        if measured is not None:
            return measured
        cost = self.table.switch_cost(from_tp, to_tp)
        if cost is not None and cost.weights_s is not None:
            return cost.weights_s
        return self.weight_bytes(from_tp, to_tp) / bandwidth

    def fixed_seconds(self, from_tp: int, to_tp: int) -> float:
        cost = self.table.switch_cost(from_tp, to_tp)
        return cost.fixed_s if cost is not None else self._default_fixed

    def graph_seconds(self, from_tp: int, to_tp: int, requests: np.ndarray | int) -> np.ndarray | float:
        """Capturing decode graphs after from_tp -> to_tp when the busiest new DP group holds ``requests``:
        one profiled capture per ladder size up to ``requests`` rounded up to a ladder size (elementwise),
        less the sizes to_tp's layout left set aside on an earlier visit (restored without a capture)."""
        cost = self.table.switch_cost(from_tp, to_tp)
        per_size = cost.graphs_s_per_size if cost is not None else 0.0
        ladder = self.graph_ladder
        n = np.asarray(requests)
        sizes = np.where(n > 0, np.minimum(np.searchsorted(ladder, n, side="left") + 1, len(ladder)), 0)
        left = self._measured.graphs_left.get(to_tp, frozenset())
        to_capture = np.concatenate([[0], np.cumsum([s not in left for s in ladder])])  # of the first k sizes
        out = per_size * to_capture[sizes]
        return float(out) if out.ndim == 0 else out

    def switch_cost(self, old: Layout, new: Layout, reqs: Sequence[RequestSnapshot], old_placement: Placement,
                    new_placement: Placement) -> SwitchCostEstimate:
        if old == new:
            return SwitchCostEstimate(0.0, 0.0, 0.0, 0.0)
        bw = max(self.bandwidth(), 1.0)
        per_token = self.table.model.kv_bytes_per_token_per_rank(old.tp)
        # Eq. 1: each source rank sends its heads of its group's cached tokens; the busiest group bounds it
        sent = max((sum(reqs[i].context_len for i in idx if reqs[i].cached) for idx in old_placement), default=0)
        migrate = sent * per_token / bw
        recompute = 0.0
        for idx in new_placement:  # Eq. 3-4, target groups prefill in parallel
            lens = [reqs[i].context_len for i in idx if reqs[i].cached]
            if lens:
                recompute = max(recompute, self.prefill_seconds(new.tp, len(lens), rms_context(lens)))
        busiest = max((len(idx) for idx in new_placement), default=0)
        return SwitchCostEstimate(self.weight_seconds(old.tp, new.tp, bw), migrate, recompute,
                                  self.fixed_seconds(old.tp, new.tp), self.graph_seconds(old.tp, new.tp, busiest))
