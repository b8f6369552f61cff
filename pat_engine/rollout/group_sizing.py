"""Straggler-aware group sizing (SAGC): pick responses per prompt online under a straggler-rate target.

Per step t the controller picks a group size G from the allowed set by Thompson sampling on

    score(G) = U(G) - lambda * p_hat(G),      U(G) = log G / log G_max

where p_hat(G) ~ Beta(a_G, b_G) is a draw from the discounted posterior of the straggler
probability of size G. A group straggles when max/median of its response lengths exceeds
the threshold kappa (SAGC uses 1.25). After the step, with S_t the share of the step's
groups that straggled:

    lambda <- clip(lambda + eta * (S_t - delta), 0, lambda_max)       (projected dual ascent)
    a_G <- gamma * a_G + stragglers,  b_G <- gamma * b_G + (groups - stragglers)

Only moves to a neighbouring size are allowed per step (SAGC App. C.3). The paper's text
lost its formulas in extraction; U, S_t as a share and the per-group Bernoulli updates are
our reading of its description, stated here as the one place they are defined.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pat_engine.rollout.config import GroupSizingConfig


def straggler_ratio(lengths: Sequence[int]) -> float:
    """max / median of one group's response lengths (1.0 for an empty or zero-median group)."""
    if not lengths:
        return 1.0
    med = statistics.median(lengths)
    return max(lengths) / med if med > 0 else 1.0


@dataclass(frozen=True)
class SizingObservation:
    size: int
    groups: int
    stragglers: int
    dual: float  # lambda after the update

    @property
    def rate(self) -> float:
        return self.stragglers / self.groups if self.groups else 0.0


class GroupSizeController:
    def __init__(self, config: GroupSizingConfig):
        self.config = config
        self.sizes = config.sizes
        self.current = config.initial if config.initial is not None else self.sizes[(len(self.sizes) - 1) // 2]
        self.dual = 0.0
        self.alpha = {g: float(config.prior[0]) for g in self.sizes}
        self.beta = {g: float(config.prior[1]) for g in self.sizes}
        self._rng = np.random.default_rng(config.seed)
        self._log_max = math.log(max(self.sizes)) if max(self.sizes) > 1 else 1.0

    def utility(self, size: int) -> float:
        return math.log(size) / self._log_max

    def candidates(self) -> tuple[int, ...]:
        if not self.config.neighbor_moves:
            return self.sizes
        i = self.sizes.index(self.current)
        return self.sizes[max(i - 1, 0): i + 2]

    def choose(self) -> int:
        """The group size for the next step (Thompson sampling on the Lagrangian score)."""
        best, best_score = self.current, -math.inf
        for g in self.candidates():
            risk = float(self._rng.beta(self.alpha[g], self.beta[g]))
            score = self.utility(g) - self.dual * risk
            if score > best_score:
                best, best_score = g, score
        self.current = best
        return best

    def observe(self, size: int, groups: Sequence[Sequence[int]]) -> SizingObservation:
        """Feed the response lengths of every group the step at ``size`` returned."""
        if size not in self.alpha:
            raise ValueError(f"group size {size} is not one of {self.sizes}")
        cfg = self.config
        events = sum(straggler_ratio(g) > cfg.straggler_threshold for g in groups)
        n = len(groups)
        if n:
            rate = events / n
            self.dual = min(max(self.dual + cfg.dual_step * (rate - cfg.target_rate), 0.0), cfg.dual_max)
            self.alpha[size] = cfg.forgetting * self.alpha[size] + events
            self.beta[size] = cfg.forgetting * self.beta[size] + (n - events)
        return SizingObservation(size, n, events, self.dual)

    def posterior_mean(self, size: int) -> float:
        return self.alpha[size] / (self.alpha[size] + self.beta[size])
