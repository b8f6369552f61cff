"""The shapes of a chat (OpenAI's, as vLLM takes them): messages with text content, the tool calls an
assistant made and the answers tools gave, and the tools a request offers. Checked once, here; rendered by
``core/chat.py``."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_TOOLS = 256  # per request: each is rendered into the prompt


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """One message: text content, and for an assistant the tool calls it made, for a tool the call it answers."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # an earlier answer sent back as it came (agent loops append the response's message): its thinking
    # reaches the template (Qwen3's reads reasoning_content); the rest of what a response message carries is
    # accepted and not rendered
    reasoning: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None  # the legacy single call: accepted only empty, as responses send it

    @model_validator(mode="after")
    def _calls_are_an_assistants(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant's message makes tool calls, not a {self.role}'s")
        if self.reasoning is not None and self.reasoning_content is not None and \
                self.reasoning != self.reasoning_content:
            raise ValueError("reasoning and reasoning_content are two names of one field; they differ here")
        for i, call in enumerate(self.tool_calls or []):
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise ValueError(f"tool_calls.{i}.function.arguments: not a JSON object")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it; a call's arguments as an object (Qwen's and Llama's
        templates write them with ``tojson``: a string would be quoted twice)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning if self.reasoning is not None else self.reasoning_content
        if thinking is not None:
            out["reasoning_content"] = thinking
        return out


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, shown to the model through the template
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)
