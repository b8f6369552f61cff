"""What OpenRLHF reads from a generation: the shape of ``vllm.RequestOutput``, without vLLM.

OpenRLHF's executors read ``.prompt_token_ids``, ``.outputs[0].token_ids``,
``.outputs[0].text``, ``.outputs[0].finish_reason`` ("length" marks a
truncated sample) and ``.outputs[0].logprobs``: one dict per generated token,
``{token_id: Logprob}``. pat-engine returns the sampled token's log-probability
only, so each dict has one entry (vLLM with ``logprobs=0``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from pat_engine import RequestOutput


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop", "length" or "abort", as vLLM
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationOutput:
    """Duck-typed ``vllm.RequestOutput`` with one completion."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: None = None
    metrics: dict = field(default_factory=dict)


def to_vllm_shape(out: RequestOutput, decode: Callable[[list[int]], str] | None = None) -> GenerationOutput:
    """``decode`` re-renders the text (e.g. honouring ``skip_special_tokens``); default: the engine's text."""
    logprobs = None
    cumulative = None
    if out.logprobs is not None:
        logprobs = [{tok: Logprob(lp)} for tok, lp in zip(out.token_ids, out.logprobs)]
        cumulative = float(sum(out.logprobs))
    text = decode(out.token_ids) if decode is not None else (out.text or "")
    stop_reason = out.token_ids[-1] if out.finish_reason == "stop" and out.token_ids else None
    completion = CompletionOutput(0, text, list(out.token_ids), cumulative, logprobs, out.finish_reason, stop_reason)
    return GenerationOutput(out.request_id, out.prompt, list(out.prompt_token_ids), [completion],
                            metrics=dict(out.metrics))
