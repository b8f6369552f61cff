"""Server-sent-event streams of completion and chat chunks (vLLM's chunk shapes).

Each event is ``data: <json>\\n\\n``; an optional usage-only chunk comes last
(``stream_options.include_usage``), then ``data: [DONE]``. A failure after the
stream started, or the server's shutdown cutting it off, is sent in-band as
``data: {"error": ...}``, followed by ``data: [DONE]``. If the client goes
away the generator is cancelled or closed, and its unfinished requests are aborted.
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator

from pat_engine.serve.async_engine import RequestGroup, Update
from pat_engine.serve.errors import APIError
from pat_engine.serve.openai.answer_parsing import AnswerParsers
from pat_engine.serve.openai.protocol import ChatCompletionRequest, CompletionRequest, UsageInfo
from pat_engine.serve.openai.translate import TextDelta, chat_logprobs, completion_logprobs

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _StreamState:
    """Per-stream bookkeeping: text deltas per choice and token counts for usage chunks."""

    def __init__(self, group: RequestGroup, tokenizer: Any, response_id: str, model: str, obj: str, opts: Any):
        self.group, self.tokenizer = group, tokenizer
        self.head = {"id": response_id, "object": obj, "created": int(time.time()), "model": model}
        self.opts = opts
        self.deltas = [TextDelta(tokenizer) for _ in group.handles]
        self.completion_tokens = 0

    def usage(self) -> dict:
        prompt = sum(len(h.prompt_token_ids) for h in self.group.handles if h.sample_index == 0)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                         total_tokens=prompt + self.completion_tokens).model_dump()

    def chunk(self, choices: list[dict], **extra: Any) -> str:
        c = {**self.head, "choices": choices, **extra}
        if self.opts is not None and self.opts.continuous_usage_stats:
            c["usage"] = self.usage()
        return sse(c)

    def text(self, up: Update) -> str:
        self.completion_tokens += len(up.new_token_ids)
        return self.deltas[up.index].update(up.token_ids, up.finished, up.text)

    def usage_chunk(self) -> str | None:
        if self.opts is not None and self.opts.include_usage:
            return sse({**self.head, "choices": [], "usage": self.usage()})
        return None

    def failure(self, up: Update) -> APIError | None:
        if up.finish_reason == "error":
            return APIError(500, f"generation failed: {up.error}")
        if up.finish_reason == "abort" and self.group.owner.closing:  # cut off by the server's shutdown
            return APIError(503, self.group.owner.cut_off_message())
        return None


async def completion_stream(group: RequestGroup, req: CompletionRequest, tokenizer: Any, model: str,
                            response_id: str) -> AsyncIterator[str]:
    st = _StreamState(group, tokenizer, response_id, model, "text_completion", req.stream_options)
    offsets = [0] * len(group.handles)
    echoed: set[int] = set()
    try:
        async for up in group.updates():
            if (err := st.failure(up)) is not None:
                yield err.sse()
                break
            text = st.text(up)
            choice: dict = {"index": up.index, "text": text, "logprobs": None,
                            "finish_reason": up.finish_reason,
                            "stop_reason": up.stop_reason}
            if req.logprobs is not None and up.new_token_ids:
                lp = completion_logprobs(req.logprob_tokenizer(tokenizer), up.new_token_ids, up.new_logprobs,
                                         req.logprobs, offsets[up.index], up.new_top_logprobs)
                offsets[up.index] = lp.text_offset[-1] + len(lp.tokens[-1])  # where the next token's text starts
                choice["logprobs"] = lp.model_dump()
            if req.return_token_ids:
                choice["token_ids"] = up.new_token_ids
                if up.index not in echoed:  # the prompt's ids ride on each choice's first chunk, as in vLLM
                    echoed.add(up.index)
                    choice["prompt_token_ids"] = group.handles[up.index].prompt_token_ids
            if text or up.finished or req.return_token_ids or choice["logprobs"]:
                yield st.chunk([choice])  # else: an unfinished multi-byte character, wait for the next token
        else:
            if (usage := st.usage_chunk()) is not None:
                yield usage
        yield DONE
    finally:
        group.abort_unfinished()  # a no-op when everything finished


async def chat_stream(group: RequestGroup, req: ChatCompletionRequest, tokenizer: Any, model: str,
                      response_id: str, parsers: AnswerParsers | None = None) -> AsyncIterator[str]:
    st = _StreamState(group, tokenizer, response_id, model, "chat.completion.chunk", req.stream_options)
    answers = [parsers.stream() for _ in group.handles] if parsers is not None else None
    try:
        first = {"prompt_token_ids": group.handles[0].prompt_token_ids} if req.return_token_ids else {}
        yield st.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None} for i in range(len(group.handles))], **first)
        async for up in group.updates():
            if (err := st.failure(up)) is not None:
                yield err.sse()
                break
            text, reasoning, finish_reason, found = st.text(up), "", up.finish_reason, []
            if answers is not None:  # reasoning and content as each becomes certain; calls at the end
                reasoning, text = answers[up.index].feed(text)
                if up.finished:
                    more_reasoning, more_text, found = answers[up.index].finish()
                    reasoning, text = reasoning + more_reasoning, text + more_text
                    finish_reason = "tool_calls" if found else finish_reason
            delta: dict = {"content": text} if text else {}
            if reasoning:
                delta.update(reasoning=reasoning, reasoning_content=reasoning)
            if found:
                delta["tool_calls"] = [{"index": k, **c.model_dump()} for k, c in enumerate(found)]
            choice: dict = {"index": up.index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            if req.logprobs and up.new_token_ids:
                choice["logprobs"] = chat_logprobs(req.logprob_tokenizer(tokenizer), up.new_token_ids,
                                                   up.new_logprobs, req.top_logprobs or 0,
                                                   up.new_top_logprobs).model_dump()
            if req.return_token_ids:
                choice["token_ids"] = up.new_token_ids
            if up.finished:
                choice["stop_reason"] = up.stop_reason
            if delta or up.finished or req.return_token_ids or choice["logprobs"]:
                yield st.chunk([choice])
        else:
            if (usage := st.usage_chunk()) is not None:
                yield usage
        yield DONE
    finally:
        group.abort_unfinished()
