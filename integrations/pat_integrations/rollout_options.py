"""The rollout policies an adapter turns on, from the framework's config: one parser, clear errors.

veRL's ``engine_kwargs.pat`` and OpenRLHF's ``pat_rollout`` take the same keys:

- ``responses_per_step`` (N): responses one RL step returns, fixed across steps (required);
- ``group_size`` (R0 when group sizing is off): default the framework's own (veRL's ``rollout.n``);
- ``tail_batching``: ``true`` or a dict of ``TailBatchingConfig`` fields (``eta``, ``resume_partials``);
- ``group_sizing``: ``true`` or a dict of ``GroupSizingConfig`` fields (``sizes``, ``straggler_threshold``, ...).

The values are checked by the dataclasses of ``pat_engine.rollout.config`` (one home for each
rule); this module only maps names and says which key was wrong. ``reward_config`` does the same
for the reward stage's options a ``rollout_step`` call takes (``RewardConfig`` fields).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pat_engine.errors import InvalidRequestError
from pat_engine.rollout.config import GroupSizingConfig, RolloutConfig, TailBatchingConfig
from pat_engine.rollout.rewards import RewardConfig

KEYS = {"responses_per_step", "group_size", "tail_batching", "group_sizing"}


def _policy(cls, value: Any, where: str):
    """``True``/``False``/None or a dict of ``cls``'s fields -> an instance or None."""
    if value is None or value is False:
        return None
    if value is True:
        return cls()
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be true, false or a dict of {cls.__name__} fields, got {value!r}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - fields)
    if unknown:
        raise ValueError(f"unknown {where} option(s) {unknown}; known: {sorted(fields)}")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # InvalidRequestError is a ValueError
        raise ValueError(f"{where}: {exc}") from None


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} must be a positive integer, got {value!r}")
    return value


def rollout_config(options: Mapping[str, Any], default_group_size: int | None, where: str) -> RolloutConfig | None:
    """The ``RolloutConfig`` the options ask for; None when neither policy is on.

    ``options``: a mapping holding (some of) ``KEYS``; other keys are the caller's business.
    ``where``: the config path to name in errors (``rollout.engine_kwargs.pat``, ``pat_rollout``).
    """
    tail = _policy(TailBatchingConfig, options.get("tail_batching"), f"{where}.tail_batching")
    sizing = _policy(GroupSizingConfig, options.get("group_sizing"), f"{where}.group_sizing")
    if tail is None and sizing is None:
        return None
    if options.get("responses_per_step") is None:
        raise ValueError(f"{where}.responses_per_step is required with tail_batching or group_sizing "
                         "(responses one RL step returns: prompts per step x responses per prompt)")
    n = _positive_int(options["responses_per_step"], f"{where}.responses_per_step")
    g = options.get("group_size", default_group_size)
    g = _positive_int(g if g is not None else 1, f"{where}.group_size")
    try:
        return RolloutConfig(responses_per_step=n, group_size=g, tail_batching=tail, group_sizing=sizing)
    except InvalidRequestError as exc:
        raise ValueError(f"{where}: {exc}") from None


def reward_config(options: Mapping[str, Any] | None, where: str = "reward_options") -> RewardConfig:
    """The reward stage's settings from a dict of ``RewardConfig`` fields (None: the defaults)."""
    return _policy(RewardConfig, options, where) or RewardConfig()
