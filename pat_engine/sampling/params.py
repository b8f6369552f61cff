"""User-facing sampling parameters (the names vLLM and SGLang users expect).

Checks that need no model happen here (types, ranges, NaN, sizes); the checks
against the model (stop and bias ids and top-k within the vocabulary, prompt
and context length) happen in ``RequestFactory`` before anything is queued.

Conventions, chosen to match vLLM:
- ``top_k`` -1 or 0 means "off" (vLLM: "set to 0 (or -1) to consider all
  tokens"; SGLang refuses 0, which would break clients written for vLLM).
- ``temperature`` below ``GREEDY_BELOW`` is greedy, as in vLLM: dividing
  logits by a tiny temperature overflows to infinity and the draw is NaN.
- ``seed`` is any integer in the signed or unsigned 64-bit range
  ``[-2**63, 2**64)``; the sampler uses it modulo 2**64. Sample ``i`` of ``n``
  draws with ``sample_seed(seed, i)``; sample 0 keeps ``seed``.
- Logit processors, in the order they apply: ``logit_bias``, ``repetition_penalty``
  (Hugging Face semantics, over prompt and output), ``frequency_penalty`` and
  ``presence_penalty`` (OpenAI semantics, over the output), temperature, then
  ``min_p``, ``top_k``, ``top_p``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from pat_engine.errors import InvalidRequestError
from pat_engine.sampling.structured import StructuredOutput

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_STOP_TOKEN_IDS = 1024  # each one is suppressed or compared per step: 10^6 of them slowed every neighbour
MAX_SAMPLES = 256  # n per prompt: each sample holds its own KV beyond the shared prompt
MAX_STOP_STRINGS = 64  # every stop string is searched after every token
MAX_STOP_STRING_CHARS = 1024
MAX_LOGIT_BIAS = 1024  # OpenAI accepts up to 300
MAX_PENALTY = 100.0
MAX_TOP_LOGPROBS = 20  # alternatives per position (OpenAI's chat maximum)


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)  # numpy integers pass too


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite_in(v: object, low: float, high: float) -> bool:
    return _is_number(v) and math.isfinite(v) and low <= v <= high


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
    # the logit processors, temperature, min_p, top-k and top-p, i.e. under the distribution sampled from
    min_new_tokens: int = 0
    repetition_penalty: float = 1.0  # Hugging Face: logits of tokens seen (prompt and output) divided
    # by it when positive, multiplied when negative
    frequency_penalty: float = 0.0  # OpenAI: minus this times the count of each token in the output
    presence_penalty: float = 0.0  # OpenAI: minus this for each token present in the output
    min_p: float = 0.0  # drop tokens whose probability is below min_p times the most likely one's
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    n: int = 1  # samples of this prompt; they share the prompt's KV blocks
    # the answer held to a JSON schema, a regex, a choice or a grammar (sampling/structured.py)
    structured_output: StructuredOutput | None = None

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
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        try:
            bias = tuple(bias)
        except TypeError:
            raise InvalidRequestError("logit_bias must map token ids to numbers") from None
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        if not all(isinstance(e, tuple) and len(e) == 2 and _is_int(e[0]) and _is_number(e[1]) for e in bias):
            raise InvalidRequestError("logit_bias must map token ids (integers) to numbers")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        if _is_number(self.temperature) and 0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        self.validate()

    def validate(self) -> None:
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise InvalidRequestError("structured_output must be a StructuredOutput (StructuredOutput.of(...))")
            # the grammar's end is an EOS the sampler must be free to draw, and the answer must stop there
            if self.min_new_tokens or self.ignore_eos:
                raise InvalidRequestError("structured output cannot be combined with min_tokens or ignore_eos: the "
                                          "answer ends with the EOS the grammar allows when it is complete")
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
        for name in ("ignore_eos", "logprobs", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_SAMPLES:
            raise InvalidRequestError(f"n must be an integer in [1, {MAX_SAMPLES}], got {self.n!r}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"prompt_logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], "
                                      f"got {self.prompt_logprobs!r}")
        if not _is_number(self.repetition_penalty) or not (math.isfinite(self.repetition_penalty)
                                                          and 0 < self.repetition_penalty <= MAX_PENALTY):
            raise InvalidRequestError(f"repetition_penalty must be in (0, {MAX_PENALTY}], got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not _finite_in(getattr(self, name), -2.0, 2.0):
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not _finite_in(self.min_p, 0.0, 1.0):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if any(not math.isfinite(b) or abs(b) > 100 for _, b in self.logit_bias):
            raise InvalidRequestError("logit_bias: each bias must be a number in [-100, 100]")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(f"stop: each stop string must be a non-empty string of at most "
                                          f"{MAX_STOP_STRING_CHARS} characters, got {str(s)[:40]!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
