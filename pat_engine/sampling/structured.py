"""Structured output (vLLM's ``StructuredOutputsParams``, OpenAI's ``response_format``): the answer is held
to a JSON schema, any JSON object, a regular expression, one of a list of strings, or an EBNF grammar.

Only the request's side lives here (what is asked, checked for size); the grammar is compiled and followed by
the driver (``core/grammar.py``, with xgrammar, the library vLLM and SGLang use), which sends each step the
tokens the grammar allows; the sampler gives every other token -inf, as it does for EOS before
``min_new_tokens``, so the draw rule and its bits are unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pat_engine.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 256 * 1024  # a schema, regex or grammar: compiled once per request on the driver
MAX_CHOICES = 1024


@dataclass
class TokenMask:
    """The tokens one draw may take, in the smallest of three forms (``core/grammar.token_mask``): ``only``
    these, every token but ``banned``, or ``words``: int32 words in native order, bit ``t % 32`` of word
    ``t // 32`` set for token ``t``. Plain data: it travels in the step messages."""

    only: tuple[int, ...] | None = None
    banned: tuple[int, ...] | None = None
    words: bytes | None = None


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one constraint: ``json`` (a JSON schema, as text), ``json_object`` (any JSON object),
    ``regex``, ``choice`` (one of these strings) or ``grammar`` (EBNF, xgrammar's dialect)."""

    kind: str
    spec: str = ""  # the schema (JSON text), regex or grammar; the choices as a JSON list; "" for json_object
    any_whitespace: bool = True  # JSON: white space allowed between tokens (vLLM's disable_any_whitespace: off)
    # (open, close): the model may think between these tags first, the constraint holding after the close
    # (a server with a reasoning parser sets them, as vLLM does); None: it holds from the first token
    think_tags: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"structured output: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.think_tags is not None and not (len(self.think_tags) == 2 and all(
                isinstance(t, str) and t for t in self.think_tags)):
            raise InvalidRequestError("structured output: think_tags must be two non-empty strings (open, close)")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"structured output: the {self.kind} must be text of at most {MAX_SPEC_CHARS} "
                                      "characters")

    @classmethod
    def of(cls, disable_any_whitespace: bool = False, **given: Any) -> "StructuredOutput | None":
        """From vLLM's fields (``json``, ``json_object``, ``regex``, ``choice``, ``grammar``); None when none is
        set. ``json`` may be a schema (dict) or its text; ``choice`` a list of strings;
        ``disable_any_whitespace``: JSON without optional white space."""
        made = cls._of(**given)
        if made is not None and disable_any_whitespace:
            if made.kind not in ("json", "json_object"):
                raise InvalidRequestError("structured output: disable_any_whitespace applies to json constraints")
            return cls(made.kind, made.spec, any_whitespace=False)
        return made

    @classmethod
    def _of(cls, **given: Any) -> "StructuredOutput | None":
        unknown = sorted(set(given) - set(KINDS))
        if unknown:
            raise InvalidRequestError(f"structured output: unknown constraint {unknown[0]!r}; known: "
                                      f"{', '.join(KINDS)}")
        set_ = {k: v for k, v in given.items() if v is not None and v is not False}
        if not set_:
            return None
        if len(set_) > 1:
            raise InvalidRequestError(f"structured output: give one constraint, got {', '.join(sorted(set_))}")
        kind, value = next(iter(set_.items()))
        if kind == "json_object":
            if value is not True:
                raise InvalidRequestError("structured output: json_object must be true")
            return cls("json_object")
        if kind == "json":
            if isinstance(value, (dict, bool)):
                return cls("json", json.dumps(value))
            if not isinstance(value, str):
                raise InvalidRequestError("structured output: json must be a JSON schema (an object or its text)")
            return cls("json", value)
        if kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) for c in value):
                raise InvalidRequestError("structured output: choice must be a non-empty list of strings")
            if len(value) > MAX_CHOICES:
                raise InvalidRequestError(f"structured output: at most {MAX_CHOICES} choices, got {len(value)}")
            return cls("choice", json.dumps(list(value)))
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"structured output: {kind} must be non-empty text")
        return cls(kind, value)

    def choices(self) -> list[str]:
        return json.loads(self.spec)
