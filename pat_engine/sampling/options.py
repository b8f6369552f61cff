"""Client sampling options onto ``SamplingParams``: the one translator every face uses.

The OpenAI server, SGLang's ``/generate``, the batch job and the RL adapters
(veRL's dict, OpenRLHF's ``vllm.SamplingParams``) hand ``to_sampling_params`` a
plain mapping of option names to values. Each name sits in one table:

- ``ALIASES``: the ``SamplingParams`` field it sets. vLLM, OpenAI and SGLang
  spell some fields differently (``max_tokens`` / ``max_new_tokens``, ``seed`` /
  ``sampling_seed``, ``include_stop_str_in_output`` / ``no_stop_trim``); two
  names for one field must agree when both are given;
- ``TEXT_ONLY``: options that change only how a face renders text; accepted
  here, applied (or not) by the face;
- ``STRUCTURED``: structured output (``sampling/structured.py``) by any of its names: vLLM's
  ``structured_outputs`` / ``guided_decoding`` dicts and ``guided_*`` fields, SGLang's ``json_schema``,
  ``regex`` and ``ebnf``; at most one constraint in all;
- ``REFUSED``: what pat-engine does not implement, with the values that mean
  "off"; any other value is refused by name. ``best_of`` is accepted only when
  it equals ``n`` (no extra candidates are drawn);
- any other name is refused as unknown.

``None`` means "not given". Values are only reshaped here (stop strings to a
tuple, logit-bias keys to token ids, numpy scalars to Python numbers); their
types and ranges are checked once, by ``SamplingParams``.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from pat_engine.errors import InvalidRequestError
from pat_engine.sampling.params import SamplingParams
from pat_engine.sampling.structured import KINDS as STRUCTURED_KINDS
from pat_engine.sampling.structured import StructuredOutput

ALIASES: dict[str, str] = {
    "max_tokens": "max_new_tokens",  # vLLM, OpenAI
    "max_new_tokens": "max_new_tokens",  # SGLang, Hugging Face
    "min_tokens": "min_new_tokens",  # vLLM
    "min_new_tokens": "min_new_tokens",  # SGLang
    "seed": "seed",  # vLLM, OpenAI
    "sampling_seed": "seed",  # SGLang
    "include_stop_str_in_output": "include_stop_str_in_output",  # vLLM
    "no_stop_trim": "include_stop_str_in_output",  # SGLang
    **{name: name for name in (
        "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos", "n",
        "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias",
        "logprobs",  # true/false, or vLLM's count (on when not None; alternatives come from top_logprobs)
        "top_logprobs", "prompt_logprobs")},
}

TEXT_ONLY = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "detokenize", "output_kind",
                       "extra_args"})

# client name -> the StructuredOutput constraint it gives; None: a dict of constraints (vLLM's params object)
STRUCTURED: dict[str, str | None] = {
    "structured_outputs": None, "guided_decoding": None,  # vLLM's StructuredOutputsParams (and its old name)
    "response_format": None,  # OpenAI's, as the OpenAI face turns it into constraints
    "guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
    "json_schema": "json", "regex": "regex", "ebnf": "grammar",  # SGLang
}

REFUSED: dict[str, tuple] = {
    "bad_words": (None, []),  # vLLM
    "allowed_token_ids": (None, []),
    "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,),  # cuts the prompt: changes the tokens, not only the text
    "stop_regex": (None, "", []),  # SGLang
    "structural_tag": (None,),
    "custom_params": (None, {}),
}

OPTION_NAMES = frozenset(ALIASES) | TEXT_ONLY | frozenset(STRUCTURED) | frozenset(REFUSED) | {"best_of"}

CLIENT_DEFAULTS: dict[str, Any] = {"temperature": 1.0}  # vLLM, OpenAI and SGLang sample at 1 unless told


def best_of_refusal(best_of: Any, n: Any) -> str | None:
    """Why ``best_of`` cannot be served (None: it can): pat-engine draws no extra candidates."""
    if best_of is None or best_of == n:
        return None
    return f"best_of={best_of} with n={n}: only best_of equal to n is supported"


def logit_bias(bias: Any) -> Any:
    """OpenAI and SGLang send token ids as strings, vLLM as integers: integers here. ``SamplingParams``
    checks the rest (pairs, sizes, ranges), the engine checks the ids against the vocabulary."""
    if not isinstance(bias, Mapping):
        return bias
    return {_token_id(key): _plain(value) for key, value in bias.items()}


def _token_id(key: Any) -> int:
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        return int(key)
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            pass
    raise InvalidRequestError(f"logit_bias: key {key!r} is not a token id")


def _plain(value: Any) -> Any:
    """numpy and other numeric scalars as Python numbers (``SamplingParams`` checks Python types)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _stop(value: Any) -> Any:
    """One stop string or several; empty ones are dropped (as SGLang does: they would match at once)."""
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, (list, tuple)):
        return tuple(s for s in value if s != "")
    return value  # SamplingParams names what is wrong with it


def _logprobs_flag(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value >= 0:  # vLLM: the number of alternatives, 0 included
        return True
    raise InvalidRequestError(f"{where}logprobs must be true, false or a count, got {value!r}")


def _reshape(field: str, value: Any, where: str) -> Any:
    if field == "stop":
        return _stop(value)
    if field == "logit_bias":
        return logit_bias(value)
    if field == "logprobs":
        return _logprobs_flag(value, where)
    return _plain(value)


def _constraints(name: str, value: Any, where: str) -> dict[str, Any]:
    """The structured-output constraints one client option gives (``STRUCTURED``)."""
    kind = STRUCTURED[name]
    if kind is not None:
        return {kind: value}
    if hasattr(value, "__dict__") and not isinstance(value, Mapping):  # vLLM's params object
        value = {k: v for k, v in vars(value).items() if not k.startswith("_")}
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{where}{name} must be an object of constraints (json, regex, choice, grammar, "
                                  "json_object)")
    # vLLM's switches that only tune a backend (disable_fallback, ...) are accepted when off
    taken = (*STRUCTURED_KINDS, "disable_any_whitespace")
    tuning = {k: v for k, v in value.items() if k not in taken and v not in (None, False, "")}
    if tuning:
        raise InvalidRequestError(f"{where}{name}.{sorted(tuning)[0]} is not supported by pat-engine (leave it unset)")
    return {k: v for k, v in value.items() if k in taken}


def _fields(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """SamplingParams fields from client names; refuses what is refused, unknown or given twice."""
    fields: dict[str, Any] = {}
    given_by: dict[str, str] = {}
    constraints: dict[str, Any] = {}
    for name, value in options.items():
        if name in STRUCTURED:
            if value is None:
                continue
            for kind, spec in _constraints(name, value, where).items():
                if spec is None or spec is False:
                    continue
                if kind in constraints and constraints[kind] != spec:
                    raise InvalidRequestError(f"{where}two different {kind} constraints are given; give one")
                constraints[kind] = spec
            continue
        if name in ALIASES:
            if value is None:
                continue
            field = ALIASES[name]
            value = _reshape(field, value, where)
            if field in fields and fields[field] != value:
                raise InvalidRequestError(f"{where}{given_by[field]}={fields[field]!r} and {name}={value!r} set the "
                                          "same option; give one")
            fields[field], given_by[field] = value, name
        elif name in REFUSED:
            if value not in REFUSED[name]:
                raise InvalidRequestError(f"{where}{name}={value!r} is not supported by pat-engine (leave it unset)")
        elif name not in TEXT_ONLY and name != "best_of":
            raise InvalidRequestError(f"unknown sampling option '{where}{name}'")
    try:
        structured = StructuredOutput.of(**constraints)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{where}{exc}") from None
    if structured is not None:
        fields["structured_output"] = structured
    return fields


def to_sampling_params(options: Mapping[str, Any], *, defaults: Mapping[str, Any] | None = None,
                       logprobs_mode: str = "raw", clamp_min_tokens: bool = False, where: str = "") -> SamplingParams:
    """``SamplingParams`` from client options.

    ``defaults``: values (client names) for options the client left out, over ``CLIENT_DEFAULTS``;
    ``max_tokens`` has no default unless the caller gives one. ``clamp_min_tokens``: lower
    ``min_tokens`` to ``max_tokens`` rather than refuse it (RL callers, whose default budget can be
    smaller than their configured minimum). ``where`` prefixes the translator's own errors
    (e.g. ``"sampling_params."``).
    """
    fields = {**_fields({**CLIENT_DEFAULTS, **(defaults or {})}, where), **_fields(options, where)}
    if "max_new_tokens" not in fields:
        raise InvalidRequestError(f"{where}max_tokens is not given and the caller has no default")
    refusal = best_of_refusal(_plain(options.get("best_of")), fields.get("n", 1))
    if refusal:
        raise InvalidRequestError(f"{where}{refusal}")
    low, high = fields.get("min_new_tokens"), fields["max_new_tokens"]
    if clamp_min_tokens and isinstance(low, int) and isinstance(high, int) and low > high:
        fields["min_new_tokens"] = high
    return SamplingParams(**fields, logprobs_mode=logprobs_mode)
