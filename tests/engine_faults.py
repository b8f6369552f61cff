"""Fault injection into a running engine's workers (a test hook the public API does not offer)."""

from __future__ import annotations

from pat_engine import Engine


def inject_fault(engine: Engine, ranks: list[int], where: str, how: str = "raise") -> None:
    """Make the next pass of ``ranks`` through ``where`` ("step", "switch_start", "reshard") raise,
    hang, or exit."""
    engine._loop.run(lambda: engine.coordinator.workers.inject_fault(where, how, ranks))
