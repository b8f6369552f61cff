"""User-facing sampling parameters (the names vLLM and SGLang users expect).

Checks that need no model happen here (types, ranges, NaN); the checks
against the model (stop ids and top-k within the vocabulary, prompt and
context length) happen in ``RequestFactory`` before anything is queued.

Conventions, chosen to match vLLM:
- ``top_k`` -1 or 0 means "off" (vLLM: "set to 0 (or -1) to consider all
  tokens"; SGLang refuses 0, which would break clients written for vLLM).
- ``temperature`` below ``GREEDY_BELOW`` is greedy, as in vLLM: dividing
  logits by a tiny temperature overflows to infinity and the draw is NaN.
- ``seed`` is any integer in the signed or unsigned 64-bit range
  ``[-2**63, 2**64)``; the sampler uses it modulo 2**64.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from pat_engine.errors import InvalidRequestError

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_STOP_TOKEN_IDS = 1024  # each one is suppressed or compared per step: 10^6 of them slowed every neighbour


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)  # numpy integers pass too


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    seed: int | None = None  # None: drawn by the engine (still layout-invariant)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-probability of each chosen token
    logprobs_mode: str = "raw"  # "raw": from the model's logits (vLLM's default); "processed": after
    # temperature, top-k and top-p, i.e. under the distribution actually sampled from
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        stops = self.stop_token_ids or ()
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
            raise InvalidRequestError(f"stop_token_ids must be a list of integers, got {type(stops).__name__}")
        stops = tuple(stops)
        if len(stops) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(stops)}")
        bad = [t for t in stops if not _is_int(t) or t < 0]
        if bad:
            raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {bad[0]!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        if _is_number(self.temperature) and 0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        self.validate()

    def validate(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise InvalidRequestError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:  # NaN fails the comparison too
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        if self.logprobs_mode not in ("raw", "processed"):
            raise InvalidRequestError(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequestError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
