"""``SpeculativeConfig``: when and how the engine drafts tokens without a draft model.

Off by default. Speculation never changes what a request generates (docs/speculative.md),
but only where a verify step's logits equal a decode step's: ``numerics="invariant"``
(bit for bit in float32 and bfloat16) or float64 (tokens equal; log-probs to ~1e-14, as
between any two float64 batch shapes). Elsewhere the engine refuses it unless
``allow_inexact`` says a valid sample that is not the speculation-off one is fine.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from pat_engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SpeculativeConfig:
    enabled: bool = False
    # when: while the engine has at most this many unfinished requests (the count the layout controller
    # sees as ClusterStatus.num_active): small batches leave the step's GEMMs idle, so verifying k more
    # tokens per row costs little; large ones are compute-bound and would pay for every rejected draft
    max_active: int = 8
    # what: drafts are continuations of the longest recent n-gram match, n in [min_ngram, max_ngram]
    min_ngram: int = 2
    max_ngram: int = 4
    max_draft: int = 8  # tokens per row and step, at most
    # each step's draft lengths maximise expected tokens per second, from each request's measured acceptance
    # and the measured cost of a step per token run (spec/budget.py); False: every proposal runs whole
    adaptive: bool = True
    siblings: bool = True  # also match in the other responses to the same prompt (n > 1, or separate requests)
    # earlier responses to the same prompt, kept after their requests end (across RL steps): LRU by prompt
    history: bool = False
    history_prompts: int = 1024  # prompts kept
    history_responses: int = 16  # responses kept per prompt (the latest)
    history_tokens: int = 4_000_000  # tokens kept in all, prompts and responses
    allow_inexact: bool = False  # fast numerics in float32/bfloat16: outputs valid, not speculation-off's bits

    def __post_init__(self) -> None:
        if self.max_active < 1 or self.max_draft < 1:
            raise InvalidRequestError(f"speculative: max_active and max_draft must be >= 1, got {self}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise InvalidRequestError(f"speculative: need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, "
                                      f"{self.max_ngram}")
        if self.history_prompts < 1 or self.history_responses < 1 or self.history_tokens < 1:
            raise InvalidRequestError("speculative: history_prompts, history_responses and history_tokens must be >= 1")

    @classmethod
    def of(cls, value: "SpeculativeConfig | dict[str, Any] | bool | None") -> "SpeculativeConfig":
        """From the engine's keyword argument: a config, a dict of its fields, True (defaults, on) or None."""
        if value is None or value is False:
            return cls()
        if value is True:
            return cls(enabled=True)
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            names = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - names)
            if unknown:
                raise InvalidRequestError(f"unknown speculative option(s): {', '.join(unknown)}")
            return cls(**{"enabled": True, **value})
        raise InvalidRequestError(f"speculative must be a SpeculativeConfig, a dict or a bool, got {type(value).__name__}")

    def check_exact(self, numerics: str, dtype: torch.dtype) -> None:
        """Refuse a configuration whose verify logits are not decode's (unless inexact is allowed)."""
        if self.enabled and not self.allow_inexact and numerics != "invariant" and dtype != torch.float64:
            raise InvalidRequestError(
                f"speculative decoding is exact only with numerics='invariant' or dtype float64 (here numerics="
                f"{numerics!r}, {str(dtype).removeprefix('torch.')}): a verify step's multi-token GEMMs and attention "
                "round differently from decode's; set numerics='invariant' (or speculative allow_inexact=True)")
