"""The layout a round starts at: throughput layout for short rounds, the predictor's pick for long ones.

A long round is a batch known to be long (its prompts were deferred for long responses,
and their lengths so far are lower bounds), so the predictor prices the whole drain under
every candidate TP with the predicted lengths and the round starts at the cheapest; the
engine's switch controller keeps switching inside either round.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pat_engine.predictor.policy import RequestSnapshot
from pat_engine.parallel.layout import Layout
from pat_engine.parallel.dp_placement import balance_by_context
from pat_engine.predictor.predictor import LatencyPredictor


def predicted_round_seconds(predictor: LatencyPredictor, world: int, tp: int, prompt_lens: Sequence[int],
                            lengths: Sequence[float], max_new_tokens: int) -> float:
    layout = Layout.for_world(world, tp)
    reqs = [RequestSnapshot(int(p), 0, int(max_new_tokens), False) for p in prompt_lens]
    placement = balance_by_context([int(p) for p in prompt_lens], layout.dp)
    rem = np.clip(np.round(np.asarray(lengths, dtype=float)), 1, max_new_tokens).astype(np.int64)
    return float(predictor.remaining_seconds(layout, reqs, placement, rem[None])[0])


def best_round_tp(predictor: LatencyPredictor, world: int, prompt_lens: Sequence[int], lengths: Sequence[float],
                  max_new_tokens: int, candidates: Sequence[int] | None = None) -> int:
    """The TP with the least predicted time to generate every response of the round."""
    tps = list(candidates or predictor.tps)
    return min(tps, key=lambda tp: (predicted_round_seconds(predictor, world, tp, prompt_lens, lengths,
                                                            max_new_tokens), tp))
