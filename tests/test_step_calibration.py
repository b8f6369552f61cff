"""The predictor's correction of the table by the engine's own decode steps (predictor/step_calibration.py)."""

from __future__ import annotations

import numpy as np
import pytest

from longtail.analytic import analytic_table, synthetic_deployment
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.policy import RequestSnapshot
from pat_engine.predictor.predictor import LatencyPredictor
from pat_engine.predictor.step_calibration import CalibrationConfig, StepCalibration
from pat_engine.predictor.table import ModelShape

SHAPE = ModelShape(num_layers=2, num_kv_heads=4, head_dim=8, elt_bytes=4)
STEP = lambda tp, b, total: 0.01 / tp + 0.001 * b + 1e-6 * total
FIT = lambda tp, b, total: total  # for StepCalibration alone: the tests pass each step's fitted seconds as its context


def predictor(calibration: CalibrationConfig | None = CalibrationConfig()) -> LatencyPredictor:
    table = analytic_table(synthetic_deployment(2, (1, 2), "synthetic", "cpu"), SHAPE, STEP, lambda tp, b, l: 1e-5 * b * l,
                           (1, 2, 4, 8), (16, 64, 256), 1e9, [], "synthetic (test)")
    return LatencyPredictor(table, calibration=calibration)


def test_nothing_seen_is_the_table():
    cal = StepCalibration(FIT)
    assert cal.factor(1, 3) == 1.0 and np.array_equal(cal.factor(2, np.array([1.0, 4.0])), [1.0, 1.0])


def test_steps_wait_in_a_backlog_until_a_price_is_asked_and_it_never_grows_past_its_bound():
    fits = []
    cal = StepCalibration(lambda tp, b, c: fits.append(c) or 0.01, CalibrationConfig(backlog=8))
    for i in range(5):
        cal.record(1, 1, i, 0.02)
    assert fits == []  # recording is an append: no fit evaluated on the step loop
    assert cal.factor(1, 1) == pytest.approx(2.0) and fits == [0, 1, 2, 3, 4]
    for i in range(5, 13):
        cal.record(1, 1, i, 0.02)
    assert fits == list(range(13))  # the eighth waiting step took them all in
    pred = predictor()
    assert pred.step_seconds(1, 4, 100) == pytest.approx(STEP(1, 4, 100))


def test_a_machine_slower_than_its_profile_is_seen_at_every_layout_the_unseen_ones_too():
    cal = StepCalibration(FIT)
    for i in range(40):
        cal.record(1, 1 + i % 8, 0.01, 0.013)
    assert cal.factor(1, 5) == pytest.approx(1.3) and cal.typical(1) == pytest.approx(1.3)
    assert cal.factor(2, 5) == pytest.approx(1.3)  # TP2 never ran: TP1's factor at the same batch
    assert np.allclose(cal.factor(2, np.array([1.0, 3.0, 64.0])), 1.3)


def test_each_batch_size_keeps_its_own_factor_and_an_unseen_one_takes_its_nearest():
    """Steps of 1-2 requests run 1.1x their fit, of 4-8 requests 1.6x (this CPU host's pattern)."""
    cal = StepCalibration(FIT)
    for _ in range(10):
        for b in (1, 2):
            cal.record(1, b, 0.01, 0.011)
        for b in (4, 8):
            cal.record(1, b, 0.01, 0.016)
    assert [cal.factor(1, b) for b in (1, 2, 3, 4, 6, 8, 40)] == pytest.approx([1.1, 1.1, 1.1, 1.6, 1.6, 1.6, 1.6])
    # a TP degree that never ran borrows batch by batch, so a switch is priced as its table says, per batch
    batches = np.array([1.0, 2.0, 4.0, 40.0])
    assert np.allclose(cal.factor(2, batches), [1.1, 1.1, 1.6, 1.6])
    assert np.allclose(cal.factor(2, batches), [cal.factor(2, b) for b in batches])
    # once TP2 has run, its own steps count, and TP1 keeps its own
    for _ in range(4):
        cal.record(2, 1, 0.01, 0.008)
    assert cal.factor(2, 1) == pytest.approx(0.8) and cal.factor(2, 8) == pytest.approx(0.8)
    assert cal.factor(1, 1) == pytest.approx(1.1)


def test_a_key_follows_a_change_of_speed_within_its_window():
    cal = StepCalibration(FIT)
    window = cal.config.window
    for _ in range(40):
        cal.record(1, 1, 0.01, 0.01)
    for _ in range(window // 2):  # the host slows by 1.25x: half the key's window is not yet enough
        cal.record(1, 1, 0.01, 0.0125)
    assert cal.factor(1, 1) < 1.25
    cal.record(1, 1, 0.01, 0.0125)  # a majority of the window
    assert cal.factor(1, 1) == pytest.approx(1.25)


def test_a_stall_is_clipped_and_outvoted():
    cal = StepCalibration(FIT)
    for i in range(20):
        cal.record(1, 2, 0.01, 5.0 if i == 10 else 0.01)  # one step of a 500x stall (a page-in, a GC)
    assert cal.factor(1, 2) == pytest.approx(1.0)
    cal.record(1, 2, 0.0, 0.01)  # nonsense is ignored: a fit of 0 s, no request, no time
    cal.record(1, 0, 0.01, 0.01)
    cal.record(1, 2, 0.01, 0.0)
    assert cal.steps == 20 and cal.typical(1) == pytest.approx(1.0)


def test_the_predictor_prices_remaining_time_with_the_correction_and_can_go_without():
    on, off = predictor(), predictor(None)
    for i in range(32):
        b = 1 + i % 4
        for p in (on, off):
            p.record_decode_step(1, b, 100 * b, 1.2 * STEP(1, b, 100 * b))
    assert on.step_seconds(1, 2, 200) == pytest.approx(1.2 * STEP(1, 2, 200))
    assert on.step_scalar(2, 3, 300) == pytest.approx(1.2 * STEP(2, 3, 300))
    assert off.step_seconds(1, 2, 200) == pytest.approx(STEP(1, 2, 200)) and off.calibration is None
    reqs = [RequestSnapshot(50, 10, 40, True) for _ in range(4)]
    rem = np.full((1, 4), 30)
    layout = Layout.for_world(2, 1)
    placement = [[0, 1], [2, 3]]
    assert on.remaining_seconds(layout, reqs, placement, rem)[0] == pytest.approx(
        1.2 * off.remaining_seconds(layout, reqs, placement, rem)[0])
