"""Attach the predictor-driven switch controller to an engine when a profile table is configured."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def attach_controller(engine) -> None:
    """Install the controller as the engine's default switch policy (or run static, saying so once)."""
    path = engine.config.profile_table
    if path is None:
        log.info("no profile table given: the engine runs with a static layout unless told to switch")
        return
    raise NotImplementedError("the profile-table controller is being built (issue 4)")
