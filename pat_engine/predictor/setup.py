"""Build the predictor-driven switch controller from a profile table, for a model and an engine config.

Pure predictor side: it knows the model, the user's config and a KV capacity check, never the
engine. Loading the table from the engine's config and installing the controller is the
engine's business (``core/controller_setup.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from pat_engine.config import EngineConfig
from pat_engine.model.arch import ModelArch
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.controller import ControllerConfig, SwitchController
from pat_engine.predictor.deployment import reshard_bytes
from pat_engine.predictor.lengths import LengthDistribution, MaxLengthBound, SnapshotLengthTracker
from pat_engine.predictor.policy import ClusterStatus
from pat_engine.predictor.predictor import LatencyPredictor
from pat_engine.predictor.step_calibration import CalibrationConfig
from pat_engine.predictor.table import ProfileTable

ESTIMATORS = ("distribution", "max")

CanHold = Callable[[Layout, ClusterStatus], bool]  # can one DP group of the layout hold every request of the status


def build_controller(arch: ModelArch, config: EngineConfig, can_hold: CanHold, table: ProfileTable,
                     estimator: str = "distribution", controller_config: ControllerConfig | None = None,
                     draws: int = 8) -> SwitchController:
    """A controller (a ``SwitchPolicy``) from a deployment-checked table.

    Args:
        arch: the served model (reshard bytes of a layout pair the table lacks).
        config: the engine's config (world, dtype, max_num_seqs, switch_check_interval, calibrate_profile).
        can_hold: KV capacity check of a target layout; the switch refuses layouts that fail it, and
            asking first keeps those refusals out of the timeline.
        table: the profile table, already checked against the deployment.
        estimator: how remaining lengths are estimated, one of ``ESTIMATORS``.
    Returns:
        The controller; its ``predictor`` is also the engine's switch cost source.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    dtype = config.torch_dtype()

    @functools.lru_cache(maxsize=None)
    def weight_bytes(from_tp: int, to_tp: int) -> int:
        return reshard_bytes(arch, dtype, Layout.for_world(config.world, from_tp), Layout.for_world(config.world, to_tp))

    predictor = LatencyPredictor(table, config.max_num_seqs, weight_bytes,
                                 graph_ladder_sizes=config.decode_graph_ladder(arch),
                                 calibration=CalibrationConfig() if config.calibrate_profile else None)
    cfg = controller_config or ControllerConfig(check_interval=config.switch_check_interval)
    tracker = None
    if estimator == "max":
        est = MaxLengthBound()
    else:
        est = LengthDistribution(draws=draws)
        tracker = SnapshotLengthTracker(est, cfg.check_interval)
    return SwitchController(predictor, est, cfg, can_hold, tracker)
