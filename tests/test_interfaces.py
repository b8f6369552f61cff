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


def test_every_control_call_has_one_handler_on_the_worker():
    """A call, its handler and its reply rule are all a new control operation needs on the worker side."""
    from collections import Counter

    from pat_engine.protocol import calls
    from pat_engine.worker.handlers import handled_calls
    from pat_engine.worker.layout_handlers import LayoutHandlers
    from pat_engine.worker.memory_handlers import MemoryHandlers
    from pat_engine.worker.profile_handlers import ProfileHandlers
    from pat_engine.worker.weight_handlers import WeightHandlers
    from pat_engine.worker.worker import Worker

    defined = {c for c in vars(calls).values()
               if isinstance(c, type) and issubclass(c, calls.WorkerCall) and c is not calls.WorkerCall}
    owners = (Worker, LayoutHandlers, WeightHandlers, MemoryHandlers, ProfileHandlers)
    handled = Counter(c for owner in owners for c in handled_calls(owner))
    assert set(handled) == defined, f"no handler: {sorted(c.__name__ for c in defined - set(handled))}"
    assert all(n == 1 for n in handled.values()), f"two handlers: {[c.__name__ for c, n in handled.items() if n > 1]}"


def test_a_call_folds_its_ranks_answers_by_its_own_rule():
    from pat_engine.protocol.calls import (
        BandwidthProbe, DestroyWeightsUpdateGroup, KVBudget, LoadWeights, ReleaseMemory, ReloadWeights,
    )

    assert ReleaseMemory(True, None).reply.combine([3, 4]) == 7
    assert LoadWeights([]).reply.combine([5, 5]) == 5
    assert KVBudget().reply.combine([300, 200]) == 200
    assert DestroyWeightsUpdateGroup("g").reply.combine([True, False]) is False
    assert BandwidthProbe(8).reply.combine([0.1, 0.2]) == [0.1, 0.2]
    assert ReloadWeights("p").reply.combine([None, None]) is None


def test_the_fault_worker_adds_its_call_and_keeps_the_rest():
    from fault_injection import FaultInjectingWorker, InjectFault

    from pat_engine.worker.handlers import handled_calls

    assert handled_calls(FaultInjectingWorker).get(InjectFault) == "inject_fault"
