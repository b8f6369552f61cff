"""Between the OpenAI schemas and the engine: prompts and sampling parameters in, response bodies out.

Used by both the HTTP server and the batch job, so a request gives the same
answer whichever way it arrives.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pat_engine.core.chat import chat_prompt
from pat_engine.errors import InvalidRequestError
from pat_engine.outputs import RequestOutput
from pat_engine.sampling.options import OPTION_NAMES, STRUCTURED, to_sampling_params
from pat_engine.sampling.params import SamplingParams
from pat_engine.serve.async_engine import EngineInput
from pat_engine.serve.openai.answer_parsing import AnswerParsers
from pat_engine.serve.openai.protocol import (
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
    response_format_constraint,
)
from pat_engine.serve.openai.tool_calls import forced_calls_schema


def sampling_params(req: Any, max_new_tokens: int, logprobs: bool, top_logprobs: int = 0,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams from the sampling fields both endpoints share; the log-prob counts and the
    token budget are read per endpoint by the caller."""
    options = {name: getattr(req, name) for name in type(req).model_fields if name in OPTION_NAMES}
    options.update(max_tokens=max_new_tokens, logprobs=logprobs, top_logprobs=top_logprobs,
                   prompt_logprobs=prompt_logprobs)
    # as constraints (None for text): one more source of structured output; two different ones are refused
    options["response_format"] = response_format_constraint(req.response_format)
    if isinstance(req, ChatCompletionRequest) and req.forces_tool_calls():  # the answer is held to calls
        if any(options.get(name) is not None for name in STRUCTURED):
            raise InvalidRequestError("tool_choice \"required\" or a named function holds the answer to tool calls; "
                                      "it cannot take another structured output constraint")
        options["guided_json"] = forced_calls_schema(req.tools, req.named_tool(), req.parallel_tool_calls)
    return to_sampling_params(options)


def completion_inputs(req: CompletionRequest) -> list[EngineInput]:
    prompt = req.prompt
    # one prompt (text or token ids) or a list of prompts, one choice each
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)
    top = req.logprobs or 0
    params = sampling_params(req, req.max_tokens, req.logprobs is not None, top,
                             top if req.echo and req.logprobs is not None else None)
    return [EngineInput(p, params) for p in prompts]


def chat_input(req: ChatCompletionRequest, tokenizer: Any, max_model_len: int,
               think_tags: tuple[str, str] | None = None) -> EngineInput:
    """``think_tags``: a server with a reasoning parser lets the model think before a structured output
    constraint holds (vLLM's rule), between these tags."""
    ids, text = chat_prompt(tokenizer, req.messages, req.chat_options(), max_model_len)
    max_new = req.max_new_tokens()
    if max_new is None:  # OpenAI's default for chat: whatever room the context leaves
        max_new = max(1, max_model_len - len(ids))
    params = sampling_params(req, max_new, req.logprobs, req.top_logprobs or 0 if req.logprobs else 0,
                             req.prompt_logprobs)
    if think_tags is not None and params.structured_output is not None:
        params = replace(params, structured_output=replace(params.structured_output, think_tags=think_tags))
    return EngineInput(ids, params, rendered=text)


# ---- outputs -----------------------------------------------------------------------------------


def prompt_logprobs_entries(out: RequestOutput, tokenizer: Any) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` of a chat response: per prompt token, None for the first, else the token
    and its alternatives by id, each with its log-prob and text."""
    if out.prompt_logprobs is None:
        return None
    tops = out.prompt_top_logprobs or [[]] * len(out.prompt_token_ids)
    entries: list[dict[str, dict[str, Any]] | None] = []
    for token, lp, alternatives in zip(out.prompt_token_ids, out.prompt_logprobs, tops):
        if lp is None:
            entries.append(None)
            continue
        pairs = [(token, lp)] + [(t, v) for t, v in alternatives if t != token]
        entries.append({str(t): {"logprob": v, "decoded_token": _token_text(tokenizer, t)} for t, v in pairs})
    return entries


def usage(outputs: list[RequestOutput]) -> UsageInfo:
    """Token counts; the n samples of a prompt count its prompt once (they share it)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs if o.sample_index == 0)
    completion = sum(len(o.token_ids) for o in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"


TopList = list[list[tuple[int, float]]]


def completion_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[float | None], top: int,
                        offset: int = 0, alternatives: TopList | None = None) -> CompletionLogprobs:
    """``text_offset`` counts the characters of each token's own text from ``offset``, so a stream
    (which passes where its previous chunk ended) gives the offsets a whole response gives.
    ``top_logprobs`` per token: the chosen token and the ``top`` most likely (None where the
    log-prob is None: the first prompt token of an echo)."""
    tokens = [_token_text(tokenizer, t) for t in token_ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    tops = None
    if top >= 1:
        tops = []
        for i, (tok, lp) in enumerate(zip(tokens, logprobs)):
            if lp is None:
                tops.append(None)
                continue
            entry = {_token_text(tokenizer, t): v for t, v in (alternatives[i][:top] if alternatives else [])}
            entry[tok] = lp
            tops.append(entry)
    return CompletionLogprobs(text_offset=offsets, token_logprobs=list(logprobs), tokens=tokens, top_logprobs=tops)


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[float], top: int,
                  alternatives: TopList | None = None) -> ChatLogprobs:
    def entry(t: int, lp: float) -> TopLogprob:
        tok = _token_text(tokenizer, t)
        return TopLogprob(token=tok, logprob=lp, bytes=list(tok.encode("utf-8")))

    content = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
        alts = [entry(a, v) for a, v in (alternatives[i][:top] if alternatives and top else [])]
        content.append(ChatLogprobToken(**entry(t, lp).model_dump(), top_logprobs=alts))
    return ChatLogprobs(content=content)


def echo_prefix(out: RequestOutput, tokenizer: Any) -> str:
    """The prompt as an echo shows it: its text when it was sent as text, else its decoded ids."""
    if out.prompt is not None:
        return out.prompt
    return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""


def completion_choice(index: int, out: RequestOutput, req: CompletionRequest, tokenizer: Any) -> CompletionChoice:
    lp = None
    prefix = echo_prefix(out, tokenizer) if req.echo else ""
    if req.logprobs is not None and out.logprobs is not None:
        ids, lps, alts = list(out.token_ids), list(out.logprobs), out.top_logprobs
        if req.echo:  # prompt tokens first, the first of them without a log-prob (as OpenAI and vLLM)
            ids = list(out.prompt_token_ids) + ids
            lps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + lps
            if alts is not None:
                alts = list(out.prompt_top_logprobs or [[]] * len(out.prompt_token_ids)) + list(alts)
        lp = completion_logprobs(req.logprob_tokenizer(tokenizer), ids, lps, req.logprobs, alternatives=alts)
    return CompletionChoice(
        index=index,
        text=prefix + (out.text or ""),
        logprobs=lp,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        token_ids=list(out.token_ids) if req.return_token_ids else None,
        prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None,
    )


def chat_choice(index: int, out: RequestOutput, req: ChatCompletionRequest, tokenizer: Any,
                parsers: AnswerParsers | None = None) -> ChatChoice:
    """One choice; with ``parsers`` its reasoning and tool calls taken out of the text."""
    lp = None
    if req.logprobs and out.logprobs is not None:
        lp = chat_logprobs(req.logprob_tokenizer(tokenizer), out.token_ids, out.logprobs, req.top_logprobs or 0,
                           out.top_logprobs)
    message, finish_reason = ChatResponseMessage(content=out.text or ""), out.finish_reason
    if parsers is not None:
        parsed = parsers.parse(out.text or "")
        message = ChatResponseMessage(content=parsed.content, tool_calls=parsed.calls, reasoning=parsed.reasoning,
                                      reasoning_content=parsed.reasoning)
        finish_reason = "tool_calls" if parsed.calls else finish_reason
    return ChatChoice(
        index=index,
        message=message,
        logprobs=lp,
        finish_reason=finish_reason,
        stop_reason=out.stop_reason,
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

    def update(self, token_ids: list[int], final: bool, engine_text: str | None = None) -> str:
        """The new text; ``engine_text``: the engine's own text so far (stop strings), used as it is."""
        if engine_text is not None:
            text = engine_text
        elif self.tokenizer is None:
            return ""
        else:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""
        common = len(self.sent)
        if not text.startswith(self.sent):  # rare: a later token changed earlier text; send only what is new
            common = next((i for i, (a, b) in enumerate(zip(text, self.sent)) if a != b), min(len(text), len(self.sent)))
        delta = text[common:] if len(text) > common else ""
        self.sent = text
        return delta
