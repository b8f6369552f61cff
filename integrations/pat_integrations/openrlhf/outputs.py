"""What OpenRLHF reads from a generation: the shape of ``vllm.RequestOutput``, without vLLM.

OpenRLHF's executors read ``.prompt_token_ids``, ``.outputs[0].token_ids``,
``.outputs[0].text``, ``.outputs[0].finish_reason`` ("length" marks a
truncated sample) and ``.outputs[0].logprobs``: one dict per generated token,
``{token_id: Logprob}``. pat-engine returns the sampled token's log-probability
only, so each dict has one entry (vLLM with ``logprobs=0``). With ``n`` > 1,
``.outputs`` holds the ``n`` samples (``index`` 0..n-1). With ``prompt_logprobs``,
``.prompt_logprobs`` is vLLM's list: None for the first prompt token, then per
token a dict holding it and the ``k`` most likely tokens at its position (``rank``
1..k; the prompt token's own rank only when it is among them).
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
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS and length

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationOutput:
    """Duck-typed ``vllm.RequestOutput``: one completion per sample."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: dict = field(default_factory=dict)


def _completion(index: int, out: RequestOutput, decode: Callable[[list[int]], str] | None) -> CompletionOutput:
    logprobs = None
    cumulative = None
    if out.logprobs is not None:
        logprobs = [{tok: Logprob(lp)} for tok, lp in zip(out.token_ids, out.logprobs)]
        cumulative = float(sum(out.logprobs))
    text = decode(out.token_ids) if decode is not None else (out.text or "")
    return CompletionOutput(index, text, list(out.token_ids), cumulative, logprobs, out.finish_reason, out.stop_reason)


def _prompt_logprobs(out: RequestOutput) -> list[dict[int, Logprob] | None] | None:
    if out.prompt_logprobs is None:
        return None
    tops = out.prompt_top_logprobs or [[] for _ in out.prompt_token_ids]
    rows: list[dict[int, Logprob] | None] = [None]
    for tok, lp, top in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], tops[1:]):
        row = {t: Logprob(v, rank=r) for r, (t, v) in enumerate(top, start=1)}
        row.setdefault(tok, Logprob(lp))
        rows.append(row)
    return rows


def to_vllm_shape(out: RequestOutput, decode: Callable[[list[int]], str] | None = None) -> GenerationOutput:
    """``decode`` re-renders each sample's text (e.g. honouring ``skip_special_tokens``); default: the
    engine's text (which stop strings cut)."""
    completions = [_completion(s.sample_index, s, decode) for s in (out.samples or [out])]
    return GenerationOutput(out.request_id, out.prompt, list(out.prompt_token_ids), completions,
                            prompt_logprobs=_prompt_logprobs(out), metrics=dict(out.metrics))
