"""The long-tail replay simulator behind bench/simulate_long_tail.py: consistency checks on small batches."""

from __future__ import annotations

import numpy as np
import pytest

from longtail.oracle import search
from longtail.policies import distribution_policy, paper_policy
from longtail.simulator import Simulation
from longtail.tables import a40_table
from longtail.workload import Batch, LongTail, make_batch
from pat_engine.predictor.predictor import LatencyPredictor


@pytest.fixture(scope="module")
def pred():
    return LatencyPredictor(a40_table(), max_num_seqs=1024)


def small_batch(seed: int = 0) -> Batch:
    return make_batch(LongTail.fit(scale=1024 / 16384), np.random.default_rng(seed), 4, 8, 1024, (50, 100))


def test_workload_matches_the_published_tail():
    lengths = LongTail.fit().sample(np.random.default_rng(0), 20000, 8, 10**9)
    assert (lengths > 8192).mean() == pytest.approx(0.1085, abs=0.01)
    assert (lengths > 16384).mean() == pytest.approx(0.0218, abs=0.004)


def test_static_replay_agrees_with_the_drain_integral(pred):
    batch = small_batch()
    for tp in (2, 8):
        sim = Simulation(pred, batch, tp, 8, 1024, 16)
        estimate = sim.finish_estimate()
        sim.run()
        assert sim.finished_at == pytest.approx(estimate, rel=1e-3)
        assert np.isfinite(sim.done_at).all() and sim.active == 0


def test_oracle_beats_static_and_replays_its_schedule(pred):
    batch = small_batch(1)
    result = search(lambda tp: Simulation(pred, batch, tp, 8, 1024, 16), 2, [2, 4, 8], coarse=4)
    assert result.seconds <= min(result.static.values()) + 1e-9
    assert result.sim.finished_at == pytest.approx(result.seconds)
    assert [s.to_tp for s in result.sim.switches] == [tp for _, tp in result.schedule]


def test_policies_run_in_the_simulator_and_switch_up_in_the_tail(pred):
    batch = small_batch(2)
    static = Simulation(pred, batch, 2, 8, 1024, 16)
    static.run()
    for policy in (paper_policy(pred, 16), distribution_policy(pred, 16, [small_batch(9).lengths], 1024)):
        sim = Simulation(pred, batch, 2, 8, 1024, 16, policy)
        sim.run()
        assert sim.switches and sim.switches[-1].to_tp == 8
        assert sim.finished_at < static.finished_at
        assert (sim.done_at > 0).all()
