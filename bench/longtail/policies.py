"""The policies the simulator compares, built exactly as the engine builds its controller."""

from __future__ import annotations

import numpy as np

from pat_engine.predictor.controller import ControllerConfig, SwitchController
from pat_engine.predictor.lengths import LengthDistribution, MaxLengthBound, SnapshotLengthTracker
from pat_engine.predictor.predictor import LatencyPredictor


def paper_policy(pred: LatencyPredictor, k: int, current_placement: str = "balanced") -> SwitchController:
    """Algorithm 1 with the paper's bound: every unfinished request runs to its cap; no lookahead.

    ``current_placement="actual"`` prices the current layout with its groups as they are: under the
    bound every imbalance lasts until the cap, so moving anywhere "rebalances" for a large predicted
    gain and the policy flaps (shown as an ablation row)."""
    return SwitchController(pred, MaxLengthBound(),
                            ControllerConfig(check_interval=k, lookahead=False, current_placement=current_placement))


def distribution_policy(pred: LatencyPredictor, k: int, history: list[np.ndarray], cap: int,
                        draws: int = 16, seed: int = 0) -> SwitchController:
    """Algorithm 1 with lengths drawn from the learned distribution (earlier stages' lengths + this stage)."""
    dist = LengthDistribution(draws=draws)
    for lengths in history:
        dist.add_stage(lengths, lengths >= cap)
    return SwitchController(pred, dist, ControllerConfig(check_interval=k, seed=seed),
                            tracker=SnapshotLengthTracker(dist, k))
