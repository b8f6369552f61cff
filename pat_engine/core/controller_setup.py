"""Attach the predictor-driven switch controller to an engine when its config names a profile table.

The engine-side glue: load the table, check it against this engine's deployment, answer the
controller's KV capacity question from the engine's ``MemoryPlan``, and install the result
through ``Engine.set_policy``. The controller itself is built in ``predictor/setup.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pat_engine.core.memory import MemoryPlan
from pat_engine.model.arch import ModelArch
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.deployment import engine_deployment
from pat_engine.predictor.policy import ClusterStatus
from pat_engine.predictor.setup import CanHold, build_controller
from pat_engine.predictor.table import ProfileTable, check_deployment

if TYPE_CHECKING:
    from pat_engine.core.engine import Engine

log = logging.getLogger(__name__)


def kv_capacity_check(arch: ModelArch, world: int, memory: MemoryPlan) -> CanHold:
    """Whether a layout is valid for the model and one DP group of it can hold every request at its longest."""
    valid = set(arch.valid_layouts(world))

    def can_hold(layout: Layout, status: ClusterStatus) -> bool:
        return (layout in valid and memory.num_blocks(layout) > 0
                and all(memory.fits(layout, r.prompt_len, r.max_new_tokens) for r in status.requests))

    return can_hold


def attach_controller(engine: Engine) -> None:
    """Install the controller as the engine's default switch policy (or run static, saying so once)."""
    cfg = engine.config
    path = cfg.profile_table
    if path is None:
        log.info("no profile table given: the engine runs with a static layout unless told to switch")
        return
    if not Path(path).is_file():
        log.warning("profile table %s not found: the engine runs static (no automatic switches); "
                    "run pat-profile to create it", path)
        return
    table = ProfileTable.load(path)
    check_deployment(table, engine_deployment(engine.arch, cfg), engine.base_layout.tp, where=f"profile table {path}")
    controller = build_controller(engine.arch, cfg, kv_capacity_check(engine.arch, cfg.world, engine.memory), table)
    engine.set_policy(controller, cost_source=controller.predictor)
    log.info("switch controller attached from %s (candidates TP%s, estimator: %s)", path,
             "/".join(map(str, controller.candidates)), controller.estimator.name)
