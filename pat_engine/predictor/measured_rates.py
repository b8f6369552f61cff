"""Rates the engine measures as it runs, used when no profile table is loaded.

Prefill throughput per TP degree (tokens per second of one group's prefill
step), and from earlier switches the KV migration bandwidth, the weight
reshard time of each layout change and which layouts' decode graphs wait
set aside for a return. Before any measurement, migration is assumed cheap
(1 GB/s) and prefill is taken from the nearest measured TP degree, scaled by
the TP ratio.
"""

from __future__ import annotations

from pat_engine.predictor.cost_source import CostSource


class MeasuredRates(CostSource):
    DEFAULT_BANDWIDTH = 1e9

    def __init__(self, alpha: float = 0.3):
        self.alpha = alpha
        self.prefill_tokens_per_s: dict[int, float] = {}
        self.kv_bandwidth: float | None = None
        self.weight_reshard_s: dict[tuple[int, int], float] = {}  # (from_tp, to_tp) -> seconds
        self.graphs_left: dict[int, frozenset[int]] = {}  # TP -> batch sizes of its graphs set aside

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def record_prefill(self, tp: int, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s[tp] = self._ema(self.prefill_tokens_per_s.get(tp), tokens / seconds)

    def record_kv_transfer(self, bytes_sent: int, seconds: float) -> None:
        if bytes_sent > 0 and seconds > 0:
            self.kv_bandwidth = self._ema(self.kv_bandwidth, bytes_sent / seconds)

    def record_weight_reshard(self, from_tp: int, to_tp: int, seconds: float) -> None:
        """A real switch's weight phase: allocating the new shards and moving them, under the engine's
        actual memory state (an idle switch in the profiler can be 2x cheaper)."""
        if seconds > 0:
            key = (from_tp, to_tp)
            self.weight_reshard_s[key] = self._ema(self.weight_reshard_s.get(key), seconds)

    def record_graphs(self, from_tp: int, left: tuple[int, ...], to_tp: int) -> None:
        self.graphs_left.pop(to_tp, None)  # restored: they are the layout's current graphs now
        if left:
            self.graphs_left[from_tp] = frozenset(left)
        else:
            self.graphs_left.pop(from_tp, None)

    def forget_graphs(self) -> None:
        self.graphs_left.clear()

    def record_decode_step(self, tp: int, batch: int, context_tokens: int, seconds: float) -> None:
        pass  # no step fit to correct without a table (the predictor's step_calibration.py)

    def bandwidth(self) -> float:
        return self.kv_bandwidth or self.DEFAULT_BANDWIDTH

    def prefill_seconds(self, tp: int, batch: int, l_rms: float) -> float:
        rates = self.prefill_tokens_per_s
        if not rates:
            return float("inf")  # unknown: never prefer recompute blindly
        if tp in rates:
            rate = rates[tp]
        else:
            near = min(rates, key=lambda t: abs(t - tp))
            rate = rates[near] * tp / near
        return batch * l_rms / rate
