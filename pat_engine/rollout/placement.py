"""Cost-aware DP placement (after FlexRL's balancing): minimise the largest predicted cost of a group.

Each request (or bundle of one prompt's responses, when they should share a group for its
prompt KV) has a predicted cost and a token footprint. Greedy LPT: bundles in decreasing
cost go to the group with the least cost so far among those under the per-group token cap
(FlexRL's M_th = alpha x mean tokens per device, alpha = 1.1); if no group has room the
bundle goes where the cap is exceeded least. ``AdmissionPlacement`` applies the same rule
one request at a time as the coordinator admits them: submitted in decreasing cost order,
that is exactly LPT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

from pat_engine.parallel.dp_placement import Placement, RebalancingPlacement


@dataclass(frozen=True)
class PlacementItem:
    cost: float  # predicted seconds (or any additive cost) the request adds to its group
    tokens: int  # KV tokens it will hold at most (prompt + predicted or maximal response)
    unit: Hashable | None = None  # requests with the same unit stay together when asked (one prompt's responses)


def _bundles(items: Sequence[PlacementItem], keep_units: bool) -> list[list[int]]:
    if not keep_units:
        return [[i] for i in range(len(items))]
    by_unit: dict[Hashable, list[int]] = {}
    out: list[list[int]] = []
    for i, it in enumerate(items):
        if it.unit is None:
            out.append([i])
        elif it.unit in by_unit:
            by_unit[it.unit].append(i)
        else:
            by_unit[it.unit] = [i]
            out.append(by_unit[it.unit])
    return out


def default_token_cap(items: Sequence[PlacementItem], groups: int, factor: float = 1.1) -> int:
    return math.ceil(factor * sum(it.tokens for it in items) / max(groups, 1))


def place_lpt(items: Sequence[PlacementItem], groups: int, token_cap: int | None = None,
              keep_units: bool = False) -> list[int]:
    """The group of every item: greedy longest-processing-time under the token cap."""
    if groups < 1:
        raise ValueError(f"need at least one group, got {groups}")
    cost = [0.0] * groups
    tokens = [0] * groups
    out = [0] * len(items)
    bundles = _bundles(items, keep_units)
    weight = [(sum(items[i].cost for i in b), sum(items[i].tokens for i in b)) for b in bundles]
    for k in sorted(range(len(bundles)), key=lambda k: (-weight[k][0], k)):
        c, t = weight[k]
        fits = [g for g in range(groups) if token_cap is None or tokens[g] + t <= token_cap]
        g = (min(fits, key=lambda g: (cost[g], tokens[g], g)) if fits
             else min(range(groups), key=lambda g: (tokens[g] + t, cost[g], g)))
        cost[g] += c
        tokens[g] += t
        for i in bundles[k]:
            out[i] = g
    return out


def group_costs(assignment: Sequence[int], items: Sequence[PlacementItem], groups: int) -> list[float]:
    cost = [0.0] * groups
    for g, it in zip(assignment, items):
        cost[g] += it.cost
    return cost


def max_group_cost(assignment: Sequence[int], items: Sequence[PlacementItem], groups: int) -> float:
    return max(group_costs(assignment, items, groups))


# ---- request costs ---------------------------------------------------------------------------------

def token_cost(prompt_len: int, response_len: float) -> float:
    """Without a predictor: tokens (prompt once, every response token once)."""
    return float(prompt_len + response_len)


class PredictorCost:
    """Predicted seconds a request adds to a group: its prefill plus its share of each decode step.

    A decode step of ``batch`` requests costs ``step_seconds(tp, batch, context)``; one request's
    share is that over ``batch``, at its mean context (prompt + half its response).
    """

    def __init__(self, predictor, tp: int, batch: int):
        self.predictor, self.tp, self.batch = predictor, tp, max(int(batch), 1)

    def __call__(self, prompt_len: int, response_len: float) -> float:
        b = self.batch
        ctx = prompt_len + response_len / 2
        per_step = float(self.predictor.step_seconds(self.tp, b, b * ctx)) / b
        return self.predictor.prefill_seconds(self.tp, 1, prompt_len) + response_len * per_step


# ---- admission hook -------------------------------------------------------------------------------

@dataclass
class Expectation:
    response_len: float  # predicted response length
    unit: Hashable | None = None


class AdmissionPlacement(RebalancingPlacement):
    """A ``RebalancingPlacement`` (``Engine.set_placement``): the DP group for one sequence as it is admitted.

    Load of a group = predicted remaining cost of its unfinished sequences (``expect()`` gives
    a request's predicted length and unit; otherwise its ``max_new_tokens`` bound is used).
    Groups over the token cap are skipped while another has room; with ``keep_units`` a request
    joins a group already holding its unit.
    """

    def __init__(self, cost: Callable[[int, float], float] = token_cost, token_cap: int | None = None,
                 keep_units: bool = False):
        self.cost = cost
        self.token_cap = token_cap
        self.keep_units = keep_units
        self.expected: dict[str, Expectation] = {}

    def expect(self, request_id: str, response_len: float, unit: Hashable | None = None) -> None:
        self.expected[request_id] = Expectation(float(response_len), unit)

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self.expected.pop(rid, None)

    def _remaining(self, request_id: str, prompt_len: int, generated: int, max_new_tokens: int) -> tuple[float, int]:
        """Predicted remaining cost and KV tokens of one request."""
        exp = self.expected.get(request_id)
        total = exp.response_len if exp else max_new_tokens
        left = max(total - generated, 1.0)
        return self.cost(prompt_len + generated, left), int(prompt_len + generated + left)

    def _seq_remaining(self, seq) -> tuple[float, int]:
        return self._remaining(seq.request_id, len(seq.prompt_ids), len(seq.output_ids), seq.params.max_new_tokens)

    def rebalance(self, requests: Sequence, groups: int, token_cap_factor: float = 1.1) -> Placement:
        """Per group, indices into ``requests`` (``predictor.policy.RequestSnapshot``s) after a layout
        switch: LPT on predicted remaining cost under the token cap.

        ``parallel.dp_placement.switch_placement`` calls it for both the switch and the
        controller pricing it, so the predicted placement is the one the switch makes.
        """
        items = []
        for r in requests:
            c, t = self._remaining(r.request_id, r.prompt_len, r.generated, r.max_new_tokens)
            exp = self.expected.get(r.request_id)
            items.append(PlacementItem(c, t, exp.unit if exp is not None else None))
        cap = default_token_cap(items, groups, token_cap_factor) if items else None
        target = place_lpt(items, groups, cap, self.keep_units)
        return [[i for i, g in enumerate(target) if g == k] for k in range(groups)]

    def __call__(self, seq, schedulers: Sequence) -> int:
        groups = len(schedulers)
        cost, tokens = [0.0] * groups, [0] * groups
        units: dict[Hashable, int] = {}
        for g, sched in enumerate(schedulers):
            for s in sched.unfinished():
                c, t = self._seq_remaining(s)
                cost[g] += c
                tokens[g] += t
                exp = self.expected.get(s.request_id)
                if exp is not None and exp.unit is not None:
                    units.setdefault(exp.unit, g)
        mine = self.expected.get(seq.request_id)
        _, need = self._seq_remaining(seq)
        if self.keep_units and mine is not None and mine.unit in units:
            return units[mine.unit]
        fits = [g for g in range(groups) if self.token_cap is None or tokens[g] + need <= self.token_cap]
        if fits:
            return min(fits, key=lambda g: (cost[g], tokens[g], g))
        return min(range(groups), key=lambda g: (tokens[g] + need, cost[g], g))
