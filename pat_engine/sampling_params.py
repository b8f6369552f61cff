"""User-facing sampling parameters (the names vLLM and SGLang users expect)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pat_engine.errors import InvalidRequestError


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
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise InvalidRequestError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens!r}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (off) or a non-negative integer, got {self.top_k!r}")
        if self.logprobs_mode not in ("raw", "processed"):
            raise InvalidRequestError(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
