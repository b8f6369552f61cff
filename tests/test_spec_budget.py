"""Draft budgets (speculative/budget.py): expected tokens per second, the step cost fit, acceptance estimates."""

from __future__ import annotations

import pytest

from pat_engine.speculative.budget import AcceptanceEstimate, StepCostFit, allocate


def test_free_verification_runs_every_proposal_whole():
    assert allocate([8, 3, 0], [0.9, 0.1, 0.9], (0.01, 0.0), rows=3) == [8, 3, 0]
    assert allocate([8, 3], [0.9, 0.1], None, rows=2) == [8, 3]  # cost unknown: explore


def test_costly_verification_drafts_only_likely_tokens():
    # a step costs 10 ms + 1 ms per token: a token is worth verifying while its chance of being
    # gained beats the step's tokens per ms so far
    k = allocate([8, 8, 8], [0.95, 0.5, 0.05], (0.010, 0.001), rows=3)
    assert k[0] > k[1] > k[2] == 0
    assert allocate([8], [0.99], (0.001, 0.001), rows=1)[0] >= 1
    assert allocate([8, 8], [0.3, 0.3], (0.001, 0.001), rows=2) == [0, 0]  # a token costs as much as the step


def test_the_allocation_maximises_expected_tokens_per_second():
    import itertools

    p, cost, rows = [0.9, 0.6, 0.3], (0.008, 0.001), 3

    def rate(k):
        expected = rows + sum(sum(pi ** (j + 1) for j in range(ki)) for pi, ki in zip(p, k))
        return expected / (cost[0] + cost[1] * (rows + sum(k)))

    best = max(itertools.product(range(6), repeat=3), key=rate)
    assert rate(allocate([5, 5, 5], p, cost, rows)) == pytest.approx(rate(best))


def test_step_cost_fit_finds_fixed_and_per_token_seconds():
    fit = StepCostFit()
    fit.add(4, 0.010)
    assert fit.params() is None  # one size seen: the slope is unknown
    for tokens in (4, 8, 16, 32, 8, 12):
        fit.add(tokens, 0.008 + 0.0005 * tokens)
    fixed, per_token = fit.params()
    assert fixed == pytest.approx(0.008) and per_token == pytest.approx(0.0005)


def test_acceptance_shrinks_to_the_engine_rate_and_drifts_back():
    est = AcceptanceEstimate()
    for _ in range(10):
        est.add(1, 4, 4)  # request 1: everything accepted
        est.add(2, 4, 0)  # request 2: nothing
    assert est.p(1) > 0.8 and est.p(2) < 0.3
    assert 0.3 < est.p(3) < 0.8  # a new request starts at the engine-wide rate
    for _ in range(200):
        est.step()  # no drafts for a long time: back toward the engine-wide rate (and the prior)
    assert abs(est.p(2) - est.p(3)) < 0.05
