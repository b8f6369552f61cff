"""Latency fits, batch interpolation, the drain integral and the switch cost, against known answers."""

from __future__ import annotations

import numpy as np
import pytest

from pat_engine.predictor.policy import RequestSnapshot
from pat_engine.parallel.layout import Layout
from longtail.analytic import analytic_table, synthetic_deployment
from pat_engine.predictor.drain import drain_seconds
from pat_engine.predictor.fit import LatencyCurve, fit_decode, fit_prefill
from pat_engine.parallel.dp_placement import balance_by_context
from pat_engine.predictor.predictor import LatencyPredictor
from pat_engine.predictor.table import ModelShape, ProfilePoint, SwitchCost

SHAPE = ModelShape(num_layers=2, num_kv_heads=4, head_dim=8, elt_bytes=4)


def points(fn, tps=(1, 2), batches=(1, 2, 4, 8), contexts=(16, 64, 256)):
    return [ProfilePoint(tp, b, c, float(b * c), 0.001 * tp * b * c, fn(tp, b, b * c))
            for tp in tps for b in batches for c in contexts]


def test_curve_interpolates_knots_and_extrapolates_with_least_squares_slope():
    curve = LatencyCurve([0, 10, 20, 30], [1.0, 2.0, 2.5, 4.0])
    assert np.allclose(curve([0, 5, 10, 15, 25, 30]), [1.0, 1.5, 2.0, 2.25, 3.25, 4.0])
    slope = np.polyfit([0, 10, 20, 30], [1.0, 2.0, 2.5, 4.0], 1)[0]
    assert curve(40) == pytest.approx(4.0 + 10 * slope)
    assert curve(-10) == pytest.approx(1.0 - 10 * slope)


def test_curve_averages_repeats_and_never_extrapolates_downhill():
    curve = LatencyCurve([10, 10, 20], [1.0, 3.0, 1.5])  # falling: slope clamped to 0 beyond the ends
    assert curve(10) == pytest.approx(2.0)
    assert curve(100) == pytest.approx(1.5)


def test_piecewise_linear_truth_is_recovered_exactly_at_profiled_batches():
    # latency linear in context with a knee at 64 tokens per request, different per batch
    def truth(tp, b, total):
        per = total / b
        return 0.01 * tp + 0.002 * b + 1e-5 * total + (3e-5 * (per - 64) * b if per > 64 else 0.0)

    fit = fit_decode(points(truth))
    for tp in (1, 2):
        for b in (1, 2, 4, 8):
            for per in (16, 40, 64, 100, 256):
                assert fit(tp, b, b * per) == pytest.approx(truth(tp, b, b * per), rel=1e-9)


def test_batch_interpolation_between_the_two_nearest_profiled_sizes():
    truth = lambda tp, b, total: 0.01 + 0.003 * np.sqrt(b) + 1e-6 * total  # not linear in b
    fit = fit_decode(points(truth))
    # b=6 lies between 4 and 8: the known answer is the linear blend of those two curves at the same total
    total = 600.0
    expected = 0.5 * truth(1, 4, total) + 0.5 * truth(1, 8, total)
    assert fit(1, 6, total) == pytest.approx(expected, rel=1e-9)
    # beyond the largest batch: straight line through the two largest
    expected = truth(1, 8, total) + (truth(1, 8, total) - truth(1, 4, total)) * (12 - 8) / 4
    assert fit(1, 12, total) == pytest.approx(expected, rel=1e-9)
    # vectorised over batch and context; empty batch costs nothing
    out = fit(2, np.array([0, 1, 3]), np.array([0.0, 100.0, 300.0]))
    assert out[0] == 0.0 and out[1] == pytest.approx(truth(2, 1, 100.0))
    with pytest.raises(KeyError, match="tp=4"):
        fit(4, 1, 1.0)


def test_an_element_gets_the_same_bits_alone_and_among_others():
    """The fit takes shortcuts by what an array holds (one bracketing pair of batch sizes, or several; x
    beyond the knots or not): each element's value must be the one it gets alone."""
    truth = lambda tp, b, total: 0.01 + 0.003 * np.sqrt(b) + 1e-6 * total
    fit = fit_decode(points(truth))
    rng = np.random.default_rng(3)
    batch = rng.integers(0, 12, 200).astype(float)  # below, between and beyond the profiled sizes, and 0
    total = rng.uniform(0, 4000, 200)  # inside and beyond the knots at either end
    together = fit(1, batch, total)
    alone = np.array([fit(1, np.array([b]), np.array([t]))[0] for b, t in zip(batch, total)])
    assert np.array_equal(together, alone)
    same_pair = np.full(5, 6.0)  # every element between 4 and 8: the branch without a selection
    assert np.array_equal(fit(1, same_pair, total[:5]), [fit(1, np.array([6.0]), np.array([t]))[0] for t in total[:5]])
    assert np.array_equal(fit(1, same_pair, total[:5]), fit(1, np.append(same_pair, 1.0), np.append(total[:5], 9.0))[:5])
    curve = LatencyCurve([10, 20, 30], [1.0, 2.0, 2.5])
    xs = np.array([0.0, 15.0, 45.0, 25.0, -5.0])
    assert np.array_equal(curve(xs), [float(curve(x)) for x in xs])


def test_prefill_fit_is_keyed_on_context_length():
    fit = fit_prefill(points(lambda tp, b, t: 0.0))
    assert fit(2, 4, 64) == pytest.approx(0.001 * 2 * 4 * 64)
    assert fit(2, 3, 64) == pytest.approx(0.001 * 2 * 3 * 64)


def brute_force_drain(step, ctx, rem, max_seqs):
    """Step-by-step reference: FIFO admission, one token per active request per step."""
    ctx, rem = list(ctx), list(rem)
    order = [i for i in range(len(rem)) if rem[i] > 0]
    active, waiting, t = order[:max_seqs], order[max_seqs:], 0.0
    while active:
        t += step(len(active), sum(ctx[i] for i in active))
        for i in active:
            ctx[i] += 1
            rem[i] -= 1
        active = [i for i in active if rem[i] > 0]
        while waiting and len(active) < max_seqs:
            active.append(waiting.pop(0))
    return t


@pytest.mark.parametrize("max_seqs", [64, 3])
def test_drain_integral_matches_step_by_step_simulation(max_seqs):
    rng = np.random.default_rng(0)
    step = lambda b, c: 0.004 + 0.0005 * b + 2e-6 * c  # linear in context: Simpson is exact
    for _ in range(5):
        n = 7
        ctx = rng.integers(5, 200, n)
        rem = rng.integers(0, 60, n)
        got = drain_seconds(step, ctx[None], rem[None], max_seqs)[0]
        assert got == pytest.approx(brute_force_drain(lambda b, c: step(b, c), ctx, rem, max_seqs), rel=1e-9)


def test_drain_is_close_when_the_fit_bends_inside_a_segment():
    step = lambda b, c: 0.004 + 0.0005 * b + 2e-6 * c + 5e-6 * np.maximum(c - 3000, 0)  # knee at 3000 tokens
    ctx, rem = np.array([100, 500, 900, 1300]), np.array([700, 900, 1200, 2000])
    got = drain_seconds(step, ctx[None], rem[None], 64)[0]
    assert got == pytest.approx(brute_force_drain(step, ctx, rem, 64), rel=2e-3)


def reqs_of(contexts, generated=0, max_new=100, cached=True):
    return [RequestSnapshot(c - generated, generated, max_new, cached) for c in contexts]


def make_predictor(step, prefill=lambda tp, b, l: 0.0, world=4, tps=(1, 2, 4), costs=(), bandwidth=1e9):
    dep = synthetic_deployment(world, tps, "t", "test")
    table = analytic_table(dep, SHAPE, step, prefill, (1, 2, 4, 8, 16), (16, 64, 256, 1024), bandwidth, list(costs), "test")
    return LatencyPredictor(table, max_num_seqs=64)


def test_remaining_time_is_the_slowest_group():
    pred = make_predictor(lambda tp, b, total: 0.01 / tp + 0.001 * b)
    reqs = reqs_of([50, 50, 50], generated=10, max_new=30)  # 20 tokens left each
    layout = Layout(1, 4)
    rem = np.array([[20, 20, 5]])
    got = pred.remaining_seconds(layout, reqs, [[0, 1], [2], [], []], rem)
    assert got[0] == pytest.approx(20 * (0.01 + 0.002))  # group 0: two requests for 20 steps
    # the switch's balancing puts one long request per group
    assert balance_by_context([10, 30, 20, 40], 2) == [[3, 0], [1, 2]]


def test_switch_cost_is_weights_plus_cheaper_kv_path_plus_fixed():
    cost = SwitchCost(1, 4, fixed_s=0.25, weight_bytes=2_000_000)
    pred = make_predictor(lambda tp, b, t: 0.01, prefill=lambda tp, b, l: 1e-4 * b * l, costs=[cost], bandwidth=1e8)
    reqs = reqs_of([100, 300, 200])
    old, new = Layout(1, 4), Layout(4, 1)
    est = pred.switch_cost(old, new, reqs, [[0, 1], [2], [], []], [[0, 1, 2]])
    kv_bytes = (100 + 300) * SHAPE.kv_bytes_per_token_per_rank(1)  # busiest source group, Eq. 1
    assert est.weights_s == pytest.approx(2_000_000 / 1e8)
    assert est.migrate_s == pytest.approx(kv_bytes / 1e8)
    l_rms = np.sqrt((100**2 + 300**2 + 200**2) / 3)
    assert est.recompute_s == pytest.approx(1e-4 * 3 * l_rms, rel=1e-6)
    assert est.total_s == pytest.approx(est.weights_s + min(est.migrate_s, est.recompute_s) + 0.25)
    assert pred.switch_cost(old, old, reqs, [], []).total_s == 0.0
    # a profiled weight reshard time (allocation and copies included) wins over bytes / bandwidth
    timed = make_predictor(lambda tp, b, t: 0.01, prefill=lambda tp, b, l: 1e-4 * b * l, bandwidth=1e8,
                           costs=[SwitchCost(1, 4, fixed_s=0.25, weight_bytes=2_000_000, weights_s=0.7)])
    assert timed.switch_cost(old, new, reqs, [[0, 1], [2], [], []], [[0, 1, 2]]).weights_s == 0.7
    # and what this engine's own switches of that kind took wins over the profile (EMA, alpha 0.3)
    timed.record_weight_reshard(1, 4, 1.7)
    assert timed.switch_cost(old, new, reqs, [[0, 1], [2], [], []], [[0, 1, 2]]).weights_s == 1.7
    timed.record_weight_reshard(1, 4, 2.7)
    assert timed.switch_cost(old, new, reqs, [[0, 1], [2], [], []], [[0, 1, 2]]).weights_s == pytest.approx(2.0)
    assert timed.switch_cost(new, old, reqs, [[0, 1, 2]], [[0, 1], [2], [], []]).weights_s != 2.0  # per direction


def test_scalar_path_equals_the_vectorised_fit():
    truth = lambda tp, b, total: 0.01 + 0.003 * np.sqrt(b) + 1e-6 * total + 2e-6 * max(total - 500, 0)
    fit = fit_decode(points(truth))
    rng = np.random.default_rng(3)
    for _ in range(200):
        tp, b, x = int(rng.choice([1, 2])), float(rng.integers(0, 14)), float(rng.uniform(-50, 3000))
        assert fit.scalar(tp, b, x) == pytest.approx(float(fit(tp, b, x)), rel=1e-12, abs=1e-15)
