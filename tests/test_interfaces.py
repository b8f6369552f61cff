"""The swappable parts declare their interfaces: cost source, placement rule, attention backend."""

from __future__ import annotations

import pytest
from longtail.analytic import analytic_table, synthetic_deployment

from pat_engine.model.layers.attention import (
    DEFAULT_BACKEND,
    AttentionBackend,
    TorchAttention,
    attention_backend,
)
from pat_engine.parallel.dp_placement import RebalancingPlacement, switch_placement
from pat_engine.predictor.cost_source import CostSource
from pat_engine.predictor.measured_rates import MeasuredRates
from pat_engine.predictor.policy import RequestSnapshot
from pat_engine.predictor.predictor import LatencyPredictor
from pat_engine.predictor.table import ModelShape


def test_both_cost_sources_are_cost_sources():
    dep = synthetic_deployment(2, (1, 2), "m", "cpu: test")
    table = analytic_table(dep, ModelShape(2, 4, 8, 4), lambda tp, b, c: 0.01, lambda tp, b, l: 1e-5 * b * l,
                           (1, 4), (16, 64), 1e9, [], "test")
    for source in (MeasuredRates(), LatencyPredictor(table)):
        assert isinstance(source, CostSource)
        source.record_kv_transfer(1_000_000, 0.01)
        assert source.bandwidth() == pytest.approx(1e8)


class Halves:
    """A placement rule with a rebalance: the first half of the requests (by seq_id) on group 0."""

    def __call__(self, seq, schedulers) -> int:
        return seq.seq_id % len(schedulers)

    def rebalance(self, requests, groups):
        half = len(requests) // 2
        return [list(range(half))] + [[] for _ in range(groups - 2)] + [list(range(half, len(requests)))]


def test_a_placement_with_rebalance_decides_a_switch():
    rule = Halves()
    assert isinstance(rule, RebalancingPlacement)
    reqs = [RequestSnapshot(10 * (i + 1), 0, 8, True, f"r{i}", seq_id=i) for i in range(4)]
    placed = switch_placement(rule, reqs, 2)
    assert sorted(i for group in placed for i in group) == [0, 1, 2, 3]


def test_the_torch_backend_is_chosen_in_one_place():
    assert isinstance(DEFAULT_BACKEND, TorchAttention) and isinstance(DEFAULT_BACKEND, AttentionBackend)
    assert attention_backend("torch").name == "torch"
    with pytest.raises(ValueError, match="attention backend must be one of"):
        attention_backend("paged")
