"""Attach the predictor-driven switch controller to an engine when a profile table is configured."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from pat_engine.core.policy import ClusterStatus
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.controller import ControllerConfig, SwitchController
from pat_engine.predictor.deployment import engine_deployment, reshard_bytes
from pat_engine.predictor.lengths import LengthDistribution, MaxLengthBound, SnapshotLengthTracker
from pat_engine.predictor.predictor import LatencyPredictor
from pat_engine.predictor.table import ProfileTable, check_deployment

log = logging.getLogger(__name__)

ESTIMATORS = ("distribution", "max")


def build_controller(engine, table: ProfileTable, estimator: str = "distribution",
                     config: ControllerConfig | None = None, draws: int = 8) -> SwitchController:
    """A controller for ``engine`` from a (deployment-checked) table; install it with ``engine.set_policy``."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    cfg = engine.config
    dtype = cfg.torch_dtype()

    @functools.lru_cache(maxsize=None)
    def weight_bytes(from_tp: int, to_tp: int) -> int:
        return reshard_bytes(engine.arch, dtype, Layout.for_world(cfg.world, from_tp), Layout.for_world(cfg.world, to_tp))

    valid = set(engine.arch.valid_layouts(cfg.world))

    def can_hold(layout: Layout, status: ClusterStatus) -> bool:
        # the switch's check_target refuses these; asking first keeps refusals out of the timeline
        return (layout in valid and engine.memory.num_blocks(layout) > 0
                and all(engine.memory.fits(layout, r.prompt_len, r.max_new_tokens) for r in status.requests))

    predictor = LatencyPredictor(table, cfg.max_num_seqs, weight_bytes)
    config = config or ControllerConfig(check_interval=cfg.switch_check_interval)
    tracker = None
    if estimator == "max":
        est = MaxLengthBound()
    else:
        est = LengthDistribution(draws=draws)
        tracker = SnapshotLengthTracker(est, config.check_interval)
    return SwitchController(predictor, est, config, can_hold, tracker)


def attach_controller(engine) -> None:
    """Install the controller as the engine's default switch policy (or run static, saying so once)."""
    path = engine.config.profile_table
    if path is None:
        log.info("no profile table given: the engine runs with a static layout unless told to switch")
        return
    if not Path(path).is_file():
        log.warning("profile table %s not found: the engine runs static (no automatic switches); "
                    "run pat-profile to create it", path)
        return
    table = ProfileTable.load(path)
    check_deployment(table, engine_deployment(engine), engine.base_layout.tp, where=f"profile table {path}")
    controller = build_controller(engine, table)
    engine.set_policy(controller, cost_source=controller.predictor)
    log.info("switch controller attached from %s (candidates TP%s, estimator: %s)", path,
             "/".join(map(str, controller.candidates)), controller.estimator.name)
