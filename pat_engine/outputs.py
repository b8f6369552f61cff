"""What ``Engine.generate`` returns for each prompt."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only; the response starts at len(prompt_token_ids)
    text: str | None  # decoded response, when the model has a tokenizer
    finish_reason: str | None  # "stop" (EOS, stop token or stop string), "length", "abort", "error"; None while running
    logprobs: list[float] | None = None  # log-probability of each chosen token, when asked for
    prompt: str | None = None
    error: str | None = None  # why a request ended with finish_reason "error" or "abort"
    metrics: dict = field(default_factory=dict)  # arrival/first-token/finish times, preemptions
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: the k most likely (id, log-prob)
    prompt_logprobs: list[float | None] | None = None  # per prompt token (None for the first), when asked
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None  # per prompt position, the top k
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None for EOS)
    sample_index: int = 0  # which of the n samples of the prompt this is
    samples: list["RequestOutput"] = field(default_factory=list)  # with n > 1: all n samples, sample 0
    # first (this object's own fields are sample 0's)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def of_prompt(samples: list[RequestOutput]) -> RequestOutput:
    """One prompt's output from its samples (sample 0 first): sample 0, carrying all of them when n > 1."""
    return replace(samples[0], samples=list(samples)) if len(samples) > 1 else samples[0]
