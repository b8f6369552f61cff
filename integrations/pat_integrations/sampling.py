"""Sampling parameters as RL frameworks send them, turned into pat-engine's ``SamplingParams``.

veRL sends a plain dict (vLLM names, ``logprobs`` as a bool); OpenRLHF sends a
``vllm.SamplingParams`` object, read here by attribute so vLLM need not be
installed. Options that would change which tokens are drawn but that
pat-engine does not implement are refused by name rather than ignored;
options that only affect detokenised text are accepted and have no effect.
"""

from __future__ import annotations

from typing import Any, Mapping

from pat_engine import InvalidRequestError, SamplingParams

# vLLM options that change only the returned text, not the tokens.
TEXT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
             "detokenize", "output_kind", "extra_args", "truncate_prompt_tokens"}

# vLLM options pat-engine does not implement, with the value that means "off".
NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0, "n": 1,
           "best_of": None, "prompt_logprobs": None, "stop": None, "bad_words": None, "logit_bias": None,
           "allowed_token_ids": None, "guided_decoding": None, "structured_outputs": None}

_PAT = {"temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "logprobs",
        "max_tokens", "max_new_tokens", "min_tokens", "min_new_tokens"}


def _check_neutral(name: str, value: Any) -> None:
    off = NEUTRAL[name]
    if value is None or value == off or (off is None and not value):
        return
    raise InvalidRequestError(f"sampling option {name}={value!r} is not supported by pat-engine (use {off!r})")


def _get(values: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if values.get(name) is not None:
            return values[name]
    return default


def _build(values: Mapping[str, Any], max_tokens: int | None, logprobs_mode: str = "raw") -> SamplingParams:
    max_new = _get(values, "max_tokens", "max_new_tokens", default=max_tokens)
    if max_new is None:
        raise InvalidRequestError("sampling params give no max_tokens and the caller has no default")
    top_k = _get(values, "top_k", default=-1)
    logprobs = values.get("logprobs")
    min_new = _get(values, "min_tokens", "min_new_tokens", default=0)
    return SamplingParams(
        max_new_tokens=int(max_new),
        temperature=float(_get(values, "temperature", default=1.0)),
        top_p=float(_get(values, "top_p", default=1.0)),
        top_k=-1 if top_k in (0, -1) else int(top_k),
        seed=None if values.get("seed") is None else int(values["seed"]),
        stop_token_ids=tuple(values.get("stop_token_ids") or ()),
        ignore_eos=bool(values.get("ignore_eos", False)),
        # veRL: a bool; vLLM: None or the number of top logprobs (0 = the sampled token only)
        logprobs=logprobs is not None and logprobs is not False,
        logprobs_mode=logprobs_mode,
        min_new_tokens=min(int(min_new), int(max_new)),
    )


def from_verl(params: Mapping[str, Any], default_max_tokens: int | None = None,
              logprobs_mode: str = "raw") -> SamplingParams:
    """veRL's agent-loop dict (``temperature``, ``top_p``, ``top_k``, ``logprobs``, ``max_tokens``, ...)."""
    for name, value in params.items():
        if name in NEUTRAL:
            _check_neutral(name, value)
        elif name not in _PAT and name not in TEXT_ONLY:
            raise InvalidRequestError(f"unknown sampling option {name!r} for pat-engine")
    return _build(params, default_max_tokens, logprobs_mode)


def from_vllm_like(params: Any, default_max_tokens: int | None = None, logprobs_mode: str = "raw") -> SamplingParams:
    """A ``vllm.SamplingParams`` (or any object with its attribute names)."""
    values = {name: getattr(params, name) for name in _PAT if hasattr(params, name)}
    for name in NEUTRAL:
        if hasattr(params, name):
            _check_neutral(name, getattr(params, name))
    return _build(values, default_max_tokens, logprobs_mode)
