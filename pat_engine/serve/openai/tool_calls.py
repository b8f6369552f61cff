"""Tool calls parsed out of an answer's text (vLLM's ``--tool-call-parser``; SGLang's names are aliases),
whole and streamed.

- ``hermes`` (SGLang: ``qwen25``, ``qwen``), the format of Qwen2.5, Qwen3 and the Hermes models: each call a
  JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>`` (the last may
  be left open by the end of the answer); the content is the text before the first call.
- ``llama3_json`` (SGLang: ``llama3``), Llama 3.1-3.3's JSON calls: an answer that opens (after white space
  or ``<|python_tag|>``) with ``{"name": ..., "parameters": {...}}``, several separated by ``;``; no content.

An answer whose calls do not parse comes back whole as content, with no calls, as vLLM's parsers do. A stream
sends content while no call can have begun and holds the rest until the choice ends, so the content and
calls a stream gives are those of the whole answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

from pat_engine.core.chat_messages import FunctionCall, ToolCall
from pat_engine.errors import InvalidRequestError
from pat_engine.serve.openai.protocol import random_id
from pat_engine.serve.openai.tags import held_suffix


@dataclass(frozen=True)
class ParsedAnswer:
    content: str | None
    calls: list[ToolCall]


class ToolParser(Protocol):
    def parse(self, text: str) -> ParsedAnswer: ...

    def sendable(self, text: str) -> int:
        """How much of an unfinished answer is content whatever follows (a prefix that only grows)."""
        ...


def _call(obj: Any, arguments_key: str) -> ToolCall | None:
    """A call from a decoded JSON object, or None if it is not one (no name, arguments not an object)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(id=random_id("chatcmpl-tool"),
                    function=FunctionCall(name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False)))


class HermesToolParser:
    start = "<tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def parse(self, text: str) -> ParsedAnswer:
        at = text.find(self.start)
        if at < 0:
            return ParsedAnswer(text, [])
        calls = []
        for closed, left_open in self._CALL.findall(text):
            try:
                call = _call(json.loads((closed or left_open).strip()), "arguments")
            except ValueError:
                call = None
            if call is None:
                return ParsedAnswer(text, [])
            calls.append(call)
        return ParsedAnswer(text[:at] or None, calls)

    def sendable(self, text: str) -> int:
        at = text.find(self.start)
        return at if at >= 0 else len(text) - held_suffix(text, self.start)


class Llama3JsonToolParser:
    python_tag = "<|python_tag|>"

    def parse(self, text: str) -> ParsedAnswer:
        body = text.lstrip()
        body = body[len(self.python_tag):] if body.startswith(self.python_tag) else body
        if not body.lstrip().startswith("{"):
            return ParsedAnswer(text, [])
        calls, decoder, rest = [], json.JSONDecoder(), body.strip()
        while rest:  # objects separated by ";"
            try:
                obj, end = decoder.raw_decode(rest)
            except ValueError:
                return ParsedAnswer(text, [])
            call = _call(obj, "parameters" if "parameters" in obj else "arguments") if isinstance(obj, dict) else None
            rest = rest[end:].lstrip()
            if call is None or (rest and not rest.startswith(";")):
                return ParsedAnswer(text, [])
            calls.append(call)
            rest = rest[1:].lstrip()
        return ParsedAnswer(None, calls)

    def sendable(self, text: str) -> int:
        head = text.lstrip()
        could_call = not head or head.startswith("{") or self.python_tag.startswith(head[:len(self.python_tag)])
        return 0 if could_call else len(text)


class ForcedToolCalls:
    """The answer of a request whose ``tool_choice`` forces calls, held by structured output to
    ``forced_calls_schema``: the named function's arguments (one call), or for "required" a JSON list of
    ``{"name", "parameters"}`` (vLLM's convention). Nothing streams as content; an answer cut off before its
    JSON closes comes back as content."""

    def __init__(self, named: str | None):
        self.named = named

    def parse(self, text: str) -> ParsedAnswer:
        try:
            value = json.loads(text, strict=False)
        except ValueError:
            return ParsedAnswer(text, [])
        if self.named is not None:
            value = [{"name": self.named, "parameters": value}]  # the arguments alone: one call
        calls = [_call(item, "parameters") for item in value] if isinstance(value, list) else []
        if not calls or any(call is None for call in calls):
            return ParsedAnswer(text, [])
        return ParsedAnswer(None, calls)  # type: ignore[arg-type]  (None was ruled out above)

    def sendable(self, text: str) -> int:
        return 0


def forced_calls_schema(tools: list[Any], named: str | None, parallel: bool) -> dict:
    """The JSON schema structured output holds a forced answer to (``ForcedToolCalls``): the named function's
    parameters, or (``tool_choice`` "required", ``named`` None) a list of calls over ``tools``."""
    def parameters(tool: Any) -> dict:
        return tool.function.parameters or {"type": "object"}

    if named is not None:
        return parameters(next(t for t in tools if t.function.name == named))
    one_call = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                            "parameters": parameters(t)},
                           "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}
    return {"type": "array", "items": one_call, "minItems": 1, **({} if parallel else {"maxItems": 1})}


TOOL_CALL_PARSERS: dict[str, type] = {
    "hermes": HermesToolParser, "qwen25": HermesToolParser, "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser, "llama3": Llama3JsonToolParser,
}


def tool_call_parser(name: str) -> ToolParser:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[name]()


def request_tool_parser(parses_calls: bool, configured: str | None, forced: bool = False,
                        named: str | None = None) -> ToolParser | None:
    """The parser a chat request's answer goes through: ``ForcedToolCalls`` when its ``tool_choice`` forces
    calls (``forced``; ``named``: the function it names), else none unless it parses calls (tools with
    ``tool_choice`` "auto"), which needs the server's parser; refused before anything is queued otherwise."""
    if forced:
        return ForcedToolCalls(named)
    if not parses_calls:
        return None
    if configured is None:
        raise InvalidRequestError('tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                                  '--tool-call-parser; send tool_choice "none" to have the answer as text')
    return tool_call_parser(configured)


class StreamedToolCalls:
    """One streamed choice: content passes while no call can have begun; the rest is parsed at the end."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text, self.sent = "", 0

    def content(self, delta: str) -> str:
        self.text += delta
        end = max(self.sent, self.parser.sendable(self.text))
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content still held and the calls, once the choice has ended."""
        answer = self.parser.parse(self.text)
        if answer.calls:
            return "", answer.calls
        return self.text[self.sent:], []
