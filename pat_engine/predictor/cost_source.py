"""``CostSource``: what a layout switch asks for its KV path estimate, and tells after it ran.

The switching service holds one (``coordinator.switching.cost_source``): ``MeasuredRates`` by default, the
``LatencyPredictor`` once a profile table is loaded (``Engine.set_policy(..., cost_source=...)``).
The switch prices migrate against recompute with it (``kv_path_cost.estimate_kv_paths``) and
reports what each switch and prefill measured, so the next estimate is better.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class CostSource(Protocol):
    def bandwidth(self) -> float:
        """Returns: the one-way per-rank KV migration bandwidth, bytes per second."""
        ...

    def prefill_seconds(self, tp: int, batch: int, l_rms: float) -> float:
        """Time of one DP group's prefill (what recomputing migrated requests costs).

        Args:
            tp: the target layout's TP degree.
            batch: requests prefilled together.
            l_rms: their root-mean-square context length (``kv_path_cost.rms_context``).
        Returns:
            Seconds; ``inf`` when nothing is known yet (recompute is then never preferred blindly).
        """
        ...

    def record_prefill(self, tp: int, tokens: int, seconds: float) -> None:
        """A prefill step ran: ``tokens`` new tokens under TP ``tp`` took ``seconds``."""
        ...

    def record_kv_transfer(self, bytes_sent: int, seconds: float) -> None:
        """A switch migrated KV: the busiest sender sent ``bytes_sent`` in ``seconds``."""
        ...

    def record_weight_reshard(self, from_tp: int, to_tp: int, seconds: float) -> None:
        """A switch's weight phase (allocate and move the new shards) from_tp -> to_tp took ``seconds``."""
        ...

    def record_graphs(self, from_tp: int, left: tuple[int, ...], to_tp: int) -> None:
        """A switch from_tp -> to_tp set aside from_tp's decode graphs of the batch sizes ``left`` on every
        rank (a return restores them: worker/graph_capture.py) and restored what to_tp had left."""
        ...

    def forget_graphs(self) -> None:
        """Every decode graph was dropped (a memory release, a new worker world)."""
        ...

    def record_decode_step(self, tp: int, batch: int, context_tokens: int, seconds: float) -> None:
        """A plain decode step (no drafts to verify) of one group ran: ``batch`` requests holding
        ``context_tokens`` in all under TP ``tp`` took ``seconds``, dispatch to result."""
        ...
