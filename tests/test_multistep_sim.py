"""The multi-step rollout simulator behind bench/simulate_rollout_steps.py: small, fast consistency checks."""

from __future__ import annotations

import numpy as np
import pytest

from longtail.multistep import PromptDataset, Variant, run_variant
from longtail.simulator import Simulation
from longtail.tables import a40_table
from longtail.workload import Batch, LongTail
from pat_engine.predictor.predictor import LatencyPredictor
from pat_engine.rollout import RolloutConfig, TailBatchingConfig


@pytest.fixture(scope="module")
def pred():
    return LatencyPredictor(a40_table(), max_num_seqs=256)


def data():
    return PromptDataset(64, LongTail.fit(prompt_corr=0.6, scale=1 / 16), 1024, (50, 100), seed=3)


def test_dataset_lengths_persist_per_prompt_and_reproduce():
    d = data()
    assert np.array_equal(d.lengths(5, 0, 8), d.lengths(5, 0, 8))
    long_uid, short_uid = int(np.argmax(d.z)), int(np.argmin(d.z))
    assert all(d.lengths(long_uid, k, 8).mean() > d.lengths(short_uid, k, 8).mean() for k in range(5))


def test_tail_batching_steps_return_n_responses_with_a_long_round_every_fifth(pred):
    cfg = RolloutConfig(32, 4, tail_batching=TailBatchingConfig(0.25))
    run = run_variant(Variant("tb", cfg, short_tp=2, long_tp=2), data(), pred, 8, 10, 256, 64)
    assert [s.kind for s in run.steps] == (["short"] * 4 + ["long"]) * 2
    assert all(s.returned == 32 and s.max_age == 0 for s in run.steps)
    assert all(s.launched == 10 * 5 for s in run.steps if s.kind == "short")


def test_short_round_ends_before_the_whole_batch_would(pred):
    cfg = RolloutConfig(32, 4, tail_batching=TailBatchingConfig(0.25))
    plain = run_variant(Variant("p", RolloutConfig(32, 4), short_tp=2), data(), pred, 8, 4, 256, 64)
    tb = run_variant(Variant("tb", cfg, short_tp=2), data(), pred, 8, 4, 256, 64)
    assert sum(s.seconds for s in tb.steps) < sum(s.seconds for s in plain.steps)


def test_a_round_simulation_without_a_stop_rule_runs_to_the_end(pred):
    from longtail.multistep import RoundSimulation

    batch = Batch(np.full(8, 10), np.arange(1, 9) * 10, 1024)
    sim = RoundSimulation(pred, batch, 2, 8, 256, 64, None)
    assert isinstance(sim, Simulation) and sim.run_round() == sim.finished_at
