"""Reasoning split out of an answer (vLLM's ``--reasoning-parser``): what a thinking model writes before
``</think>`` goes to the message's ``reasoning`` (and ``reasoning_content``, its older name in vLLM and
DeepSeek's API), the rest is the content, where tool calls are then looked for.

- ``deepseek_r1`` (DeepSeek-R1, QwQ): the answer is reasoning until ``</think>``; an opening ``<think>`` may be
  written or left to the prompt; an answer cut off before ``</think>`` is all reasoning.
- ``qwen3``: as ``deepseek_r1`` when ``</think>`` is there, or when the answer opens with ``<think>``;
  otherwise the answer is all content (thinking was off: the template closed the block in the prompt).

A stream sends reasoning as soon as it is certain to be reasoning and content once ``</think>`` is seen;
text that could still be a tag, and a ``qwen3`` answer that has not yet said whether it thinks, wait. The
streamed pieces join into what the whole answer gives.
"""

from __future__ import annotations

from dataclasses import dataclass

from pat_engine.serve.openai.tags import held_suffix

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    thinks_unless_told: bool  # True (deepseek_r1): an answer without tags is reasoning; False (qwen3): content

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None where there is none."""
        opened = text.startswith(START)
        body = text[len(START):] if opened else text
        reasoning, closed, content = body.partition(END)
        if closed:
            return reasoning, content or None
        if opened or self.thinks_unless_told:
            return body, None
        return None, text

    def certain(self, text: str) -> tuple[str, str] | None:
        """(reasoning, content) of an unfinished answer that no later text can change, or None while it is
        undecided whether the answer thinks; each part is a prefix of what the whole answer gives."""
        opened = text.startswith(START)
        if not opened and START.startswith(text):  # could still become the opening tag
            return "", ""
        body = text[len(START):] if opened else text
        reasoning, closed, content = body.partition(END)
        if closed:
            return reasoning, content
        if opened or self.thinks_unless_told:
            return body[:len(body) - held_suffix(body, END)], ""
        return None


def think_tags(reasoning_parser: str | None) -> tuple[str, str] | None:
    """The tags a server's reasoning parser reads, for structured output to wait for (None: no parser)."""
    return (START, END) if reasoning_parser is not None else None


_DEEPSEEK_R1, _QWEN3 = ReasoningParser("deepseek_r1", True), ReasoningParser("qwen3", False)
REASONING_PARSERS = {"deepseek_r1": _DEEPSEEK_R1, "deepseek-r1": _DEEPSEEK_R1, "qwen3": _QWEN3}  # "deepseek-r1": SGLang


class StreamedReasoning:
    """One streamed choice: the reasoning and content deltas that can be sent so far."""

    def __init__(self, parser: ReasoningParser):
        self.parser, self.text = parser, ""
        self.sent_reasoning, self.sent_content = 0, 0

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        now = self.parser.certain(self.text)
        return self._send(*now) if now is not None else ("", "")

    def finish(self) -> tuple[str, str]:
        reasoning, content = self.parser.split(self.text)
        return self._send(reasoning or "", content or "")

    def _send(self, reasoning: str, content: str) -> tuple[str, str]:
        out = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return out
