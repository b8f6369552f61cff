"""Remaining-length estimators: Kaplan-Meier, conditional draws, and length inference from snapshots."""

from __future__ import annotations

import numpy as np
import pytest

from pat_engine.predictor.policy import RequestSnapshot
from pat_engine.predictor.lengths import LengthDistribution, MaxLengthBound, SnapshotLengthTracker, kaplan_meier


def test_kaplan_meier_hand_computed():
    # events 1, 2, 3 and one request still running at 2 (censored)
    s = kaplan_meier(np.array([1, 2, 3]), np.array([2]))
    assert s.times.tolist() == [1, 2, 3]
    assert s.surv.tolist() == pytest.approx([3 / 4, 3 / 4 * 2 / 3, 0.0])
    assert s.at(np.array([0, 1, 2.5, 9])).tolist() == pytest.approx([1.0, 0.75, 0.5, 0.0])


def test_kaplan_meier_without_censoring_is_the_empirical_survival():
    data = np.array([5, 1, 3, 3, 8])
    s = kaplan_meier(data, np.zeros(0))
    for t in (0, 1, 3, 5, 8):
        assert s.at(np.array([t]))[0] == pytest.approx((data > t).mean())


def reqs(generated: list[int], cap: int = 1000, prompt: int = 10) -> list[RequestSnapshot]:
    return [RequestSnapshot(prompt, g, cap, True) for g in generated]


def test_no_data_means_the_max_length_bound():
    r = reqs([100, 300])
    rng = np.random.default_rng(0)
    assert LengthDistribution().draws(r, rng).tolist() == MaxLengthBound().draws(r, rng).tolist() * 1
    assert MaxLengthBound().draws(r, rng).tolist() == [[900, 700]]


def test_draws_are_conditioned_on_what_was_generated():
    dist = LengthDistribution(draws=200)
    dist.add_stage(list(range(100, 400)))  # lengths uniform on [100, 400)
    d = dist.draws(reqs([300, 50]), np.random.default_rng(1))
    assert d.shape == (200, 2)
    assert ((d[:, 0] >= 1) & (d[:, 0] <= 99)).all()  # 300 generated: ends before 400
    assert d[:, 0].mean() == pytest.approx(50, abs=8)
    assert ((d[:, 1] >= 50) & (d[:, 1] <= 349)).all()
    beyond = dist.draws(reqs([600]), np.random.default_rng(1))
    assert (beyond == 400).all()  # beyond anything seen: the cap (conservative)
    # a request still running at 600 is evidence of a tail past 400: some draws now go to the cap
    mixed = dist.draws(reqs([300, 600]), np.random.default_rng(1))
    assert 0 < (mixed[:, 0] == 700).mean() < 0.2


def test_capped_responses_are_censored_not_events():
    dist = LengthDistribution(draws=50)
    dist.add_stage([100] * 10 + [200] * 10, capped=[False] * 10 + [True] * 10)  # half hit a cap of 200
    d = dist.draws(reqs([150], cap=1000), np.random.default_rng(0))
    assert (d == 850).all()  # nothing is known beyond 200 except that some went on: the new cap


def snap(gens: list[int]) -> list[RequestSnapshot]:
    return reqs(gens, cap=100)


def test_tracker_infers_finished_lengths_and_closes_stages():
    dist = LengthDistribution()
    tr = SnapshotLengthTracker(dist, interval=8)
    tr.update(snap([8, 8, 8, 8]), 8)
    tr.update(snap([16, 16, 16]), 16)  # one finished between steps 8 and 16
    assert tr.finished == [12]
    tr.update(snap([24]), 24)
    assert sorted(tr.finished) == [12, 20, 20]
    tr.update(snap([4, 4]), 4)  # the step counter went back: a new stage began
    lengths, capped = dist.stages[-1]
    assert sorted(lengths.tolist()) == [12, 20, 20, 28] and not capped.any()
    assert tr.finished == []


def test_tracker_marks_requests_that_reach_their_cap():
    dist = LengthDistribution()
    tr = SnapshotLengthTracker(dist, interval=8)
    tr.update(snap([96, 50]), 96)
    tr.update(snap([58]), 104)
    assert tr.finished == [100] and tr.finished_capped == [True]
