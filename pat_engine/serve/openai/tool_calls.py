"""Tool calls parsed out of an answer's text (vLLM's ``--tool-call-parser``), whole and streamed.

``hermes``, the format of Qwen2.5, Qwen3 and the Hermes models: each call a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>`` (the last one may be
left open by the end of the answer). The answer's content is its text before the first call. A call that is
not such an object leaves the whole text as content, with no calls, as vLLM's parser does.

A stream sends content until a call could begin and holds the rest until the choice ends, so the content
and the calls a stream gives are those of the whole answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pat_engine.core.chat_messages import FunctionCall, ToolCall
from pat_engine.errors import InvalidRequestError
from pat_engine.serve.openai.protocol import random_id
from pat_engine.serve.openai.tags import held_suffix


@dataclass(frozen=True)
class ParsedAnswer:
    content: str | None
    calls: list[ToolCall]


class HermesToolParser:
    start, end = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def parse(self, text: str) -> ParsedAnswer:
        at = text.find(self.start)
        if at < 0:
            return ParsedAnswer(text, [])
        calls = []
        for closed, left_open in self._CALL.findall(text):
            call = self._call((closed or left_open).strip())
            if call is None:
                return ParsedAnswer(text, [])
            calls.append(call)
        return ParsedAnswer(text[:at] or None, calls)

    @staticmethod
    def _call(body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = obj.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        return ToolCall(id=random_id("chatcmpl-tool"),
                        function=FunctionCall(name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False)))


TOOL_CALL_PARSERS = {"hermes": HermesToolParser}


def tool_call_parser(name: str) -> HermesToolParser:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[name]()


def request_tool_parser(parses_calls: bool, configured: str | None) -> HermesToolParser | None:
    """The parser a chat request's answer goes through: none unless it parses calls (tools with
    ``tool_choice`` "auto"), which needs the server's parser; refused before anything is queued otherwise."""
    if not parses_calls:
        return None
    if configured is None:
        raise InvalidRequestError('tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                                  '--tool-call-parser; send tool_choice "none" to have the answer as text')
    return tool_call_parser(configured)


class StreamedToolCalls:
    """One streamed choice: content passes until the first call's tag could begin; the rest is parsed at the end."""

    def __init__(self, parser: HermesToolParser, parallel: bool = True):
        self.parser, self.parallel = parser, parallel
        self.text, self.sent, self.holding = "", 0, False

    def content(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        at = self.text.find(self.parser.start, self.sent)
        if at >= 0:
            self.holding = True
            out, self.sent = self.text[self.sent:at], at
            return out
        end = max(self.sent, len(self.text) - held_suffix(self.text, self.parser.start))
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content still held and the calls, once the choice has ended."""
        answer = self.parser.parse(self.text)
        if answer.calls:
            return "", answer.calls if self.parallel else answer.calls[:1]
        return self.text[self.sent:], []
