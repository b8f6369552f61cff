"""``SamplingSpec``: what a worker needs to sample one sequence, as plain data (no torch).

It travels in the step and switch messages (``pat_engine.protocol``), so it imports nothing
heavier than ``SamplingParams``; the sampler turns a batch of them into tensors
(``sampler.SamplingBatch.build``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pat_engine.sampling.params import SamplingParams


@dataclass(frozen=True)
class SamplingSpec:
    """How one sequence is sampled (sent once per admission)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: bool
    processed_logprobs: bool = False  # log-prob under the distribution sampled from, not the raw logits
    top_logprobs: int = 0  # also report the k most likely tokens and their log-probs
    repetition_penalty: float = 1.0  # logit processors (sampling/processors.py)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_len: int = 0  # where the output starts in the sequence (frequency and presence count the output)

    @classmethod
    def of(cls, params: SamplingParams, seed: int, prompt_len: int) -> "SamplingSpec":
        """The spec of a request with ``params``, drawing with ``seed``, whose prompt has ``prompt_len`` tokens."""
        return cls(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=int(seed),
                   logprobs=params.logprobs, processed_logprobs=params.logprobs_mode == "processed",
                   top_logprobs=params.top_logprobs if params.logprobs else 0,
                   repetition_penalty=params.repetition_penalty, frequency_penalty=params.frequency_penalty,
                   presence_penalty=params.presence_penalty, min_p=params.min_p, logit_bias=params.logit_bias,
                   prompt_len=prompt_len)

    @property
    def has_penalties(self) -> bool:
        """Whether logit bias or a penalty changes the logits (then the worker keeps the token history)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias))
