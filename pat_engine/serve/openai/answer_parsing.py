"""A chat answer's text as a message: the reasoning split off first (``--reasoning-parser``,
``reasoning.py``), then tool calls parsed out of the content (``--tool-call-parser``, ``tool_calls.py``),
the whole answer and a stream giving the same message."""

from __future__ import annotations

from dataclasses import dataclass

from pat_engine.core.chat_messages import ToolCall
from pat_engine.serve.openai.protocol import ChatCompletionRequest
from pat_engine.serve.openai.reasoning import REASONING_PARSERS, ReasoningParser, StreamedReasoning
from pat_engine.serve.openai.tool_calls import StreamedToolCalls, ToolParser, request_tool_parser


@dataclass(frozen=True)
class ParsedMessage:
    reasoning: str | None
    content: str | None
    calls: list[ToolCall]


@dataclass(frozen=True)
class AnswerParsers:
    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None
    parallel_tool_calls: bool = True  # false: the first call only
    include_reasoning: bool = True  # false: the reasoning is split off and dropped (vLLM's include_reasoning)

    def parse(self, text: str) -> ParsedMessage:
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        reasoning = reasoning if self.include_reasoning else None
        calls: list[ToolCall] = []
        if self.tools is not None and content:
            answer = self.tools.parse(content)
            content, calls = answer.content, self.kept_calls(answer.calls)
        return ParsedMessage(reasoning, content, calls)

    def kept_calls(self, calls: list[ToolCall]) -> list[ToolCall]:
        """``parallel_tool_calls: false``: the first call only."""
        return calls if self.parallel_tool_calls else calls[:1]

    def stream(self) -> "StreamedAnswer":
        return StreamedAnswer(self)


class StreamedAnswer:
    """One streamed choice: (reasoning, content) deltas as text comes, the calls once the choice has ended."""

    def __init__(self, parsers: AnswerParsers):
        self.parsers = parsers
        self.reasoning = StreamedReasoning(parsers.reasoning) if parsers.reasoning else None
        self.tools = StreamedToolCalls(parsers.tools) if parsers.tools else None

    def feed(self, delta: str) -> tuple[str, str]:
        reasoning, content = self.reasoning.feed(delta) if self.reasoning else ("", delta)
        return self._kept(reasoning), self.tools.content(content) if self.tools else content

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        reasoning = self._kept(reasoning)
        calls: list[ToolCall] = []
        if self.tools is not None:
            content = self.tools.content(content)
            rest, calls = self.tools.finish()
            content, calls = content + rest, self.parsers.kept_calls(calls)
        return reasoning, content, calls

    def _kept(self, reasoning: str) -> str:
        return reasoning if self.parsers.include_reasoning else ""


def answer_parsers(req: ChatCompletionRequest, tool_call_parser: str | None,
                   reasoning_parser: str | None) -> AnswerParsers | None:
    """What a chat request's answer goes through on a server with these parsers (None: plain text); a
    request whose calls need a parser the server lacks is refused before anything is queued."""
    tools = request_tool_parser(req.parses_tool_calls(), tool_call_parser, req.forces_tool_calls(), req.named_tool())
    split = reasoning_parser is not None and req.separate_reasoning
    reasoning = REASONING_PARSERS[reasoning_parser] if split else None  # type: ignore[index]
    if tools is None and reasoning is None:
        return None
    return AnswerParsers(reasoning, tools, req.parallel_tool_calls, req.include_reasoning)
