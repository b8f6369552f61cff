"""Build a profile table from a latency *model* instead of measurements.

Used for deployments we cannot measure here (a paper-calibrated 8xA40 table,
an analytic 8xH100 model: ``tables.py``) and by tests with known answers (pytest
puts ``bench/`` on the path). Such tables say so in ``meta["source"]``; nothing
in them is a measurement.
"""

from __future__ import annotations

from typing import Callable, Iterable

from pat_engine.predictor.table import Deployment, ModelShape, ProfilePoint, ProfileTable, SwitchCost

StepModel = Callable[[int, int, float], float]  # (tp, batch per group, total context tokens) -> s
PrefillModel = Callable[[int, int, float], float]  # (tp, requests, context length each) -> s


def analytic_table(deployment: Deployment, model: ModelShape, step: StepModel, prefill: PrefillModel,
                   batches: Iterable[int], contexts: Iterable[int], bandwidth: float,
                   switch_costs: list[SwitchCost], source: str, **meta) -> ProfileTable:
    """Evaluate the models on the grid (every candidate tp x batch x context)."""
    points = []
    for tp in deployment.candidate_tps:
        for b in batches:
            for c in contexts:
                points.append(ProfilePoint(tp, b, c, float(b * c), float(prefill(tp, b, c)), float(step(tp, b, b * c))))
    return ProfileTable(deployment, model, points, bandwidth, list(switch_costs), {"source": source, **meta})


def synthetic_deployment(world: int, tps: Iterable[int], name: str, device: str, dtype: str = "bfloat16",
                         fingerprint: str = "synthetic") -> Deployment:
    return Deployment(model_fingerprint=fingerprint, model_name=name, dtype=dtype, device=device, world=world,
                      candidate_tps=tuple(tps), block_size=16)
