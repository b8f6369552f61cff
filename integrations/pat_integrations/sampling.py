"""Sampling parameters as RL frameworks send them, through pat-engine's one translator.

veRL sends a plain dict (vLLM names, ``logprobs`` as a bool); OpenRLHF sends a
``vllm.SamplingParams`` object, read here by attribute so vLLM need not be
installed. What each name means, and which options are refused, is decided in
``pat_engine.sampling.options``. Both clamp ``min_tokens`` to the token budget:
an RL caller's default budget (the room left in the context) can be smaller
than its configured minimum.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pat_engine import SamplingParams
from pat_engine.sampling.options import OPTION_NAMES, to_sampling_params


def from_verl(params: Mapping[str, Any], default_max_tokens: int | None = None, logprobs_mode: str = "raw",
              defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """veRL's agent-loop dict (``temperature``, ``top_p``, ``top_k``, ``logprobs``, ``max_tokens``, ...);
    ``defaults``: values for options it leaves out (veRL's rollout config: ``repetition_penalty``, ...)."""
    return to_sampling_params(params, defaults={**(defaults or {}), "max_tokens": default_max_tokens},
                              logprobs_mode=logprobs_mode, clamp_min_tokens=True)


def from_vllm_like(params: Any, default_max_tokens: int | None = None, logprobs_mode: str = "raw") -> SamplingParams:
    """A ``vllm.SamplingParams`` (or any object with its attribute names); attributes it lacks are unset."""
    values = {name: getattr(params, name) for name in OPTION_NAMES if hasattr(params, name)}
    return to_sampling_params(values, defaults={"max_tokens": default_max_tokens}, logprobs_mode=logprobs_mode,
                              clamp_min_tokens=True)
