"""Between the OpenAI schemas and the engine: prompts and sampling parameters in, response bodies out.

Used by both the HTTP server and the batch job, so a request gives the same
answer whichever way it arrives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pat_engine.core.inputs import max_prompt_chars
from pat_engine.errors import InvalidRequestError
from pat_engine.outputs import RequestOutput
from pat_engine.sampling_params import SamplingParams
from pat_engine.serve.openai_protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatLogprobToken,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    TopLogprob,
    UsageInfo,
)

Prompt = str | list[int]
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when a request gives none


@dataclass(frozen=True)
class EngineInput:
    """What ``Engine.submit`` takes for one choice."""

    prompt: Prompt
    params: SamplingParams


def apply_chat_template(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a chat, rendered with the tokenizer's own template (no extra BOS: the template has it)."""
    if tokenizer is None:
        raise InvalidRequestError("chat needs a tokenizer but the model has none; send token ids to /v1/completions")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("the model's tokenizer has no chat template; use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # a template may raise on roles it does not know
        raise InvalidRequestError(f"the chat template rejected the messages: {exc}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def sampling_params(req: Any, max_new_tokens: int, logprobs: bool) -> SamplingParams:
    """SamplingParams from the fields both endpoints share (SamplingParams validates them)."""
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        min_new_tokens=req.min_tokens,
    )


def completion_inputs(req: CompletionRequest) -> list[EngineInput]:
    prompt = req.prompt
    # one prompt (text or token ids) or a list of prompts, one choice each
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)
    params = sampling_params(req, req.max_tokens, req.logprobs is not None)
    return [EngineInput(p, params) for p in prompts]


def chat_input(req: ChatCompletionRequest, tokenizer: Any, max_model_len: int) -> EngineInput:
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in req.messages]
    chars, limit = sum(len(m["content"]) for m in messages), max_prompt_chars(max_model_len)
    if chars > limit:  # refuse before rendering and tokenizing, as for text prompts
        raise InvalidRequestError(f"messages hold {chars} characters, more than the {limit} that can fit a context "
                                  f"of {max_model_len} tokens; shorten the chat")
    ids = apply_chat_template(tokenizer, messages, req.add_generation_prompt)
    max_new = req.max_new_tokens()
    if max_new is None:  # OpenAI's default for chat: whatever room the context leaves
        max_new = max(1, max_model_len - len(ids))
    return EngineInput(ids, sampling_params(req, max_new, req.logprobs))


# ---- outputs -----------------------------------------------------------------------------------


def stop_reason(finish_reason: str | None, token_ids: list[int], stop_token_ids: list[int] | None) -> int | None:
    """The stop token that ended the request (None for EOS or length), as vLLM reports it."""
    if finish_reason == "stop" and token_ids and token_ids[-1] in (stop_token_ids or ()):
        return token_ids[-1]
    return None


def usage(outputs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(o.token_ids) for o in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"


def completion_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[float], top: int,
                        offset: int = 0) -> CompletionLogprobs:
    tokens = [_token_text(tokenizer, t) for t in token_ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    tops = [{tok: lp} for tok, lp in zip(tokens, logprobs)] if top >= 1 else None
    return CompletionLogprobs(text_offset=offsets, token_logprobs=list(logprobs), tokens=tokens, top_logprobs=tops)


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[float], top: int) -> ChatLogprobs:
    content = []
    for t, lp in zip(token_ids, logprobs):
        tok = _token_text(tokenizer, t)
        entry = TopLogprob(token=tok, logprob=lp, bytes=list(tok.encode("utf-8")))
        content.append(ChatLogprobToken(**entry.model_dump(), top_logprobs=[entry] if top >= 1 else []))
    return ChatLogprobs(content=content)


def completion_choice(index: int, out: RequestOutput, req: CompletionRequest, tokenizer: Any) -> CompletionChoice:
    lp = None
    if req.logprobs is not None and out.logprobs is not None:
        lp = completion_logprobs(tokenizer, out.token_ids, out.logprobs, req.logprobs)
    return CompletionChoice(
        index=index,
        text=out.text or "",
        logprobs=lp,
        finish_reason=out.finish_reason,
        stop_reason=stop_reason(out.finish_reason, out.token_ids, req.stop_token_ids),
        token_ids=list(out.token_ids) if req.return_token_ids else None,
        prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None,
    )


def chat_choice(out: RequestOutput, req: ChatCompletionRequest, tokenizer: Any) -> ChatChoice:
    lp = None
    if req.logprobs and out.logprobs is not None:
        lp = chat_logprobs(tokenizer, out.token_ids, out.logprobs, req.top_logprobs or 0)
    return ChatChoice(
        index=0,
        message=ChatResponseMessage(content=out.text or ""),
        logprobs=lp,
        finish_reason=out.finish_reason,
        stop_reason=stop_reason(out.finish_reason, out.token_ids, req.stop_token_ids),
        token_ids=list(out.token_ids) if req.return_token_ids else None,
    )


class TextDelta:
    """Turns a growing list of token ids into text deltas whose concatenation is the final text.

    The whole response is decoded each time (byte-level BPE may merge across
    tokens) and a trailing U+FFFD (an unfinished multi-byte character) is held
    back until the next token completes it.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.sent = ""

    def update(self, token_ids: list[int], final: bool) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""
        common = len(self.sent)
        if not text.startswith(self.sent):  # rare: a later token changed earlier text; send only what is new
            common = next((i for i, (a, b) in enumerate(zip(text, self.sent)) if a != b), min(len(text), len(self.sent)))
        delta = text[common:] if len(text) > common else ""
        self.sent = text
        return delta
