"""Rollout scheduling across RL steps, on top of the engine's public API.

Policies (pure logic, no processes): tail batching with long rounds (RollPacker),
straggler-aware group sizing (SAGC), and the scheduler that ties them together;
``runner.RolloutRunner`` drives an ``Engine`` with them. See docs/rollout.md.
"""

from pat_engine.rollout.config import GroupSizingConfig, RolloutConfig, TailBatchingConfig
from pat_engine.rollout.group_sizing import GroupSizeController, straggler_ratio
from pat_engine.rollout.scheduler import RolloutScheduler
from pat_engine.rollout.tail_batching import PromptEntry, RoundPlan, RoundTracker, TailBatcher

__all__ = [
    "GroupSizeController", "GroupSizingConfig", "PromptEntry", "RolloutConfig",
    "RolloutScheduler", "RoundPlan", "RoundTracker", "TailBatcher", "TailBatchingConfig",
    "straggler_ratio",
]
