"""The paper's cost model for unfinished-request state (Sec. 4.3, Eq. 1-4).

migrate:   T_mig = V_send / B, with V_send the KV bytes on the busiest sender
           (2 * sum(l_i) * layers * kv_dim * bytes / tp_src in the paper; here
           taken from the actual migration plan, which also covers GQA and
           KV-head replication) and B the measured one-way per-rank bandwidth.
recompute: T_rec = prefill(tp_dst, n, l_rms), with l_rms = sqrt(mean(l_i^2))
           standing in for the ragged batch (it keeps the quadratic attention
           term), from a profile table or from measured prefill throughput.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


def rms_context(lengths: list[int]) -> float:
    return math.sqrt(sum(l * l for l in lengths) / len(lengths)) if lengths else 0.0


@dataclass(frozen=True)
class KVPathEstimate:
    migrate_s: float
    recompute_s: float
    migrate_bytes: int  # on the busiest sender

    @property
    def path(self) -> str:
        return "migrate" if self.migrate_s <= self.recompute_s else "recompute"


def estimate_kv_paths(
    busiest_sender_bytes: int,
    bandwidth_bytes_per_s: float,
    context_lengths_per_group: list[list[int]],
    prefill_seconds: Callable[[int, float], float],
) -> KVPathEstimate:
    """``prefill_seconds(batch, l_rms)``: time of one target group's prefill; groups run in parallel."""
    migrate = busiest_sender_bytes / max(bandwidth_bytes_per_s, 1.0)
    recompute = max((prefill_seconds(len(ls), rms_context(ls)) for ls in context_lengths_per_group if ls), default=0.0)
    return KVPathEstimate(migrate, recompute, busiest_sender_bytes)
