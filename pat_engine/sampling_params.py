"""User-facing sampling parameters (the names vLLM and SGLang users expect)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pat_engine.errors import InvalidRequestError

MAX_SAMPLES = 256  # n per prompt: each sample holds its own KV beyond the shared prompt
MAX_STOP_STRINGS = 64  # every stop string is searched after every token
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # OpenAI accepts up to 300
MAX_PENALTY = 100.0
MAX_TOP_LOGPROBS = 20  # alternatives per position (OpenAI's chat maximum)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    seed: int | None = None  # None: drawn by the engine (still layout-invariant)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)  # end at the first of these strings in the text
    include_stop_str_in_output: bool = False  # keep the matched stop string at the end of the text
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-probability of each chosen token
    top_logprobs: int = 0  # with logprobs: also the k most likely tokens at each position (raw log-probs)
    prompt_logprobs: int | None = None  # also the log-probability of each prompt token (and the top k)
    logprobs_mode: str = "raw"  # "raw": from the model's logits (vLLM's default); "processed": after
    # temperature, top-k and top-p, i.e. under the distribution actually sampled from
    min_new_tokens: int = 0
    repetition_penalty: float = 1.0  # Hugging Face: logits of tokens seen (prompt and output) divided
    # by it when positive, multiplied when negative
    frequency_penalty: float = 0.0  # OpenAI: minus this times the count of each token in the output
    presence_penalty: float = 0.0  # OpenAI: minus this for each token present in the output
    min_p: float = 0.0  # drop tokens whose probability is below min_p times the most likely one's
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    n: int = 1  # samples of this prompt; they share the prompt's KV blocks. Sample i draws with seed
    # sample_seed(seed, i): sample 0 uses ``seed`` itself, so n=1 and sample 0 of n agree

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"prompt_logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], "
                                      f"got {self.prompt_logprobs!r}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_PENALTY):
            raise InvalidRequestError(f"repetition_penalty must be in (0, {MAX_PENALTY}], got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        if any(not math.isfinite(b) or abs(b) > 100 for _, b in self.logit_bias):
            raise InvalidRequestError("logit_bias: each bias must be a number in [-100, 100]")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(f"stop: each stop string must be a non-empty string of at most "
                                          f"{MAX_STOP_STRING_CHARS} characters, got {str(s)[:40]!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_SAMPLES:
            raise InvalidRequestError(f"n must be an integer in [1, {MAX_SAMPLES}], got {self.n!r}")
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
    def has_logit_processors(self) -> bool:
        """Whether penalties, min_p or a logit bias change the logits before sampling."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.min_p != 0.0 or bool(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
