"""Chats to prompt text: the tokenizer's chat template, or the one the deployment names (vLLM's
``--chat-template``), rendered with a request's options (``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``).

One home for the rules everything that takes a chat shares (the OpenAI chat endpoint, both kinds of batch
line, ``/tokenize``, ``Engine.chat``). Errors are ``InvalidRequestError`` naming the option at fault; a
template the deployment names is checked when the engine starts, so a typo fails there rather than on every
chat request.
"""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from pydantic import BaseModel, Field, ValidationError, model_validator

from pat_engine.core.chat_messages import MAX_TOOLS, ChatMessage, ToolDefinition
from pat_engine.core.inputs import max_prompt_chars
from pat_engine.errors import InvalidRequestError, validation_message

# A text with one of these is a template; anything else is taken for a file's path (vLLM's two cases, checked
# markup first, so a template's text is never looked up on disk).
_JINJA_MARKERS = ("{{", "{%")


@dataclass(frozen=True)
class ChatOptions:
    """How a chat is rendered (the fields of vLLM's chat request that shape the prompt)."""

    add_generation_prompt: bool = True  # open the assistant's turn after the last message
    continue_final_message: bool = False  # leave the last (assistant) message open, to be continued
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra template variables (enable_thinking)
    tools: list[dict[str, Any]] | None = None  # the tools offered, as the template reads them

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true: "
                                      "send add_generation_prompt=false to continue the last message")
        check_template_kwargs(self.template_kwargs)


class ChatFields(BaseModel):
    """The request fields that shape how a chat is rendered (vLLM's names), for every request schema that
    takes a chat: the chat endpoint, batch lines, ``/tokenize``."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    chat_template_kwargs: dict[str, Any] | None = None  # template variables (e.g. Qwen3's enable_thinking)
    tools: list[ToolDefinition] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)  # for the model

    @model_validator(mode="after")
    def _options_hold(self):
        self.chat_options()  # a conflict is a validation error naming the fields
        return self

    def chat_options(self) -> ChatOptions:
        tools = [t.for_template() for t in self.tools] if self.tools else None
        return ChatOptions(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs or {},
                           tools)

    def check_chat_fields_need(self, messages: Any) -> None:
        """For schemas where a chat is one choice among prompts: the chat fields only come with messages."""
        given = [name for name in ChatFields.model_fields if name in self.model_fields_set]
        if given and messages is None:
            raise ValueError(f"{', '.join(given)}: only with messages")


def chat_options(**fields: Any) -> ChatOptions:
    """``ChatOptions`` from the chat fields given as Python values (``Engine.chat``); what is wrong with them
    is an ``InvalidRequestError`` naming the field."""
    try:
        return ChatFields.model_validate(fields).chat_options()
    except ValidationError as exc:
        raise InvalidRequestError(validation_message(exc)) from None


@functools.cache
def reserved_template_kwargs() -> frozenset[str]:
    """Names a request's ``chat_template_kwargs`` may not use: ``apply_chat_template``'s own parameters (they
    would change how the chat is rendered or returned, not what the template sees) and ``messages``, which
    the template receives from the chat itself. Read from transformers' signature so it follows the version."""
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}
    return frozenset(named | {"messages"})


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    if not kwargs:  # the common case needs no transformers import
        return
    clash = sorted(set(kwargs) & reserved_template_kwargs())
    if clash:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(map(repr, clash))}: "
                                  "the request's own fields (or the chat) give those")


def install_chat_template(tokenizer: Any, value: str, tokenizer_dir: str) -> None:
    """Put the template a deployment names (``EngineConfig.chat_template``) in place of the tokenizer's."""
    template = resolve_chat_template(value)
    if tokenizer is None:
        raise InvalidRequestError(f"a chat template needs a tokenizer, and {tokenizer_dir!r} has none; name one "
                                  "with --tokenizer")
    tokenizer.chat_template = template


def resolve_chat_template(value: str) -> str:
    """The template a deployment names: the text itself when it holds Jinja markup, else the file at that
    path; its syntax is checked here (transformers' own compiler, so its extensions parse)."""
    if any(marker in value for marker in _JINJA_MARKERS):
        text = value
    else:
        path = Path(value)
        if not path.is_file():
            raise InvalidRequestError(f"chat template {value!r}: no such file, and no Jinja markup ({{{{ or {{%) "
                                      "to take it for a template")
        text = path.read_text()
    try:
        # private, but the one compiler whose extensions (the generation tag) match how the template runs
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without it: the first chat reports a broken template instead
        return text
    try:
        _compile_jinja_template(text)
    except Exception as exc:  # jinja2.TemplateSyntaxError, named with its line
        raise InvalidRequestError(f"chat template {value[:80]!r}: {type(exc).__name__}: {exc}") from None
    return text


def render_chat(tokenizer: Any, messages: list[dict], options: ChatOptions = ChatOptions()) -> str:
    """A chat as the tokenizer's template renders it; clear errors for a missing tokenizer or template and for
    a template that rejects the messages."""
    if tokenizer is None:
        raise InvalidRequestError("chat needs a tokenizer but the model has none; send token ids as a completion")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("the model's tokenizer has no chat template; start the engine with "
                                  "--chat-template, or send a completion")
    try:
        # continue_final_message only when asked: tokenizers older than it (and stand-ins) take the call as before
        more: dict[str, Any] = {"continue_final_message": True} if options.continue_final_message else {}
        if options.tools:
            more["tools"] = options.tools
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=options.add_generation_prompt, **more,
                                             **options.template_kwargs)
    except Exception as exc:  # a template may raise on roles it does not know, or on a variable's value
        raise InvalidRequestError(f"the chat template rejected the messages: {exc}") from None


def chat_prompt(tokenizer: Any, messages: Sequence[ChatMessage | dict], options: ChatOptions,
                max_model_len: int) -> tuple[list[int], str]:
    """A chat's token ids and its rendered text. A chat whose messages and template variables hold more
    characters than the context could take is refused before it is rendered and tokenized, as a text
    prompt is (``core/inputs.py``). Plain dicts are checked against ``ChatMessage``."""
    if not isinstance(messages, (list, tuple)):
        raise InvalidRequestError(f"a chat is a list of messages, got {type(messages).__name__}")
    parsed = []
    for i, message in enumerate(messages):
        try:
            parsed.append(message if isinstance(message, ChatMessage) else ChatMessage.model_validate(message))
        except ValidationError as exc:
            raise InvalidRequestError(f"message {i}: {validation_message(exc)}") from None
    if not parsed:
        raise InvalidRequestError("a chat needs at least one message")
    chat = [m.for_template() for m in parsed]
    variables = len(json.dumps(options.template_kwargs)) if options.template_kwargs else 0
    variables += len(json.dumps(options.tools)) if options.tools else 0
    variables += sum(len(json.dumps(m["tool_calls"])) for m in chat if "tool_calls" in m)
    text_chars = sum(len(m["content"]) + len(m.get("reasoning_content", "")) for m in chat)
    chars, limit = text_chars + variables, max_prompt_chars(max_model_len)
    if chars > limit:
        held = "messages, tools and chat_template_kwargs hold" if variables else "messages hold"
        raise InvalidRequestError(f"{held} {chars} characters, more than the {limit} that can fit a context "
                                  f"of {max_model_len} tokens; shorten the chat")
    text = render_chat(tokenizer, chat, options)
    return chat_tokens(tokenizer, text), text


def chat_tokens(tokenizer: Any, text: str) -> list[int]:
    """A rendered chat's token ids (no extra BOS: the template has it)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def apply_chat_template(tokenizer: Any, messages: list[dict], options: ChatOptions = ChatOptions()) -> list[int]:
    """Token ids of a chat, rendered with the tokenizer's own template."""
    return chat_tokens(tokenizer, render_chat(tokenizer, messages, options))
