"""Request and response schemas of the OpenAI-compatible API (the shapes vLLM's server uses).

Requests forbid unknown fields: a misspelt or unsupported option (``functions``,
...) is a 400 naming the field rather than silently ignored. OpenAI fields
whose default value is all the engine does (``best_of=1``) are accepted with
that value, so clients that send explicit defaults work; any other value is a
400 naming the field.
Value ranges of sampling fields are checked once, by ``SamplingParams``.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pat_engine.core.chat import ChatFields
from pat_engine.core.chat_messages import ChatMessage, ToolCall
from pat_engine.sampling.options import best_of_refusal
from pat_engine.sampling.params import MAX_SAMPLES, MAX_STOP_TOKEN_IDS, SEED_MAX, SEED_MIN

MAX_MESSAGES = 2048  # per chat request; a chat of 200k messages peaked the driver at 2.8 GB
MAX_PROMPTS = 256  # prompts per completion request (one choice each)


def response_format_constraint(fmt: dict | None) -> dict | None:
    """OpenAI's ``response_format`` as structured-output constraints (``sampling/structured.py``): None for
    text, ``json_object`` for any JSON object, ``json`` for ``json_schema``'s schema."""
    kind = fmt.get("type") if fmt is not None else "text"
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError("response_format json_schema needs {\"json_schema\": {\"name\", \"schema\": {...}}}")
        return {"json": spec.get("schema", {})}
    raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Fields both endpoints share (OpenAI names, plus vLLM's extras the engine supports)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)  # None: 1.0, as OpenAI
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=-1, ge=-1)  # -1 or 0: off (vLLM); above the vocabulary: refused by the engine
    n: int = Field(default=1, ge=1, le=MAX_SAMPLES)
    best_of: int | None = None  # accepted when it equals n (no extra candidates are drawn)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False  # vLLM extra
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM extra (Hugging Face semantics)
    min_p: float = 0.0  # vLLM extra
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    user: str | None = None
    response_format: dict | None = None  # text, json_object or json_schema (structured output)
    # vLLM's structured-output extras (sampling/options.py reads them)
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # "auto" (the default when a chat offers tools): calls are parsed from the answer by the server's
    # --tool-call-parser; "none": the answer is text. "required" and a named function would need
    # structured output, which the engine does not do
    tool_choice: str | dict | None = None
    return_token_ids: bool = False  # vLLM extra: add token_ids / prompt_token_ids to each choice
    # vLLM extra: log-prob entries name their tokens "token_id:<id>" (the exact ids RL trainers need)
    return_tokens_as_token_ids: bool = False

    def logprob_tokenizer(self, tokenizer: Any) -> Any:
        """The tokenizer log-prob entries name their tokens with; None names them by id ("token_id:<id>")."""
        return None if self.return_tokens_as_token_ids else tokenizer

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v is None or v == "":
            return None
        return [v] if isinstance(v, str) else v

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, v):
        if v is not None:
            response_format_constraint(v)  # names what is wrong with it
        return v

    @field_validator("tool_choice")
    @classmethod
    def _known_choice(cls, v):
        named = isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) \
            and isinstance(v["function"].get("name"), str)
        if v not in (None, "none", "auto", "required") and not named:
            raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                             '{"name": ...}}')
        return v

    @model_validator(mode="after")
    def _choice_needs_tools(self):
        tools = getattr(self, "tools", None) or []
        if self.tool_choice not in (None, "none") and not tools:
            raise ValueError("tool_choice other than \"none\" needs tools (a chat's tools field)")
        if isinstance(self.tool_choice, dict):
            name = self.tool_choice["function"]["name"]
            if name not in [t.function.name for t in tools]:
                raise ValueError(f"tool_choice names the function {name!r}, which tools does not offer")
        return self

    @model_validator(mode="after")
    def _best_of_is_n(self):
        refusal = best_of_refusal(self.best_of, self.n)
        if refusal:
            raise ValueError(refusal)
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)  # OpenAI's maximum for completions
    echo: bool = False  # the prompt comes back before the completion (with logprobs: its log-probs too)

    @model_validator(mode="after")
    def _echo_not_streamed(self):
        if self.echo and self.stream:
            raise ValueError("echo is supported without stream only")
        return self

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and not isinstance(v[0], int) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(v)}")
        return v


class ChatCompletionRequest(_SamplingFields, ChatFields):  # vLLM extras: ChatFields
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # newer OpenAI name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM extra: the prompt's log-probs (with this many alternatives), in the response's prompt_logprobs
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    parallel_tool_calls: bool = True  # false: at most the first call is returned
    include_reasoning: bool = True  # vLLM extra: false drops the reasoning a --reasoning-parser split off
    separate_reasoning: bool = True  # SGLang extra: false leaves the reasoning in the content, unsplit

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is supported without stream only")
        return self

    def parses_tool_calls(self) -> bool:
        """Whether the answer's tool calls are parsed out (OpenAI's default: "auto" when tools are given)."""
        return bool(self.tools) and (self.tool_choice or "auto") == "auto"

    def forces_tool_calls(self) -> bool:
        """``tool_choice`` "required" or a named function: the answer is held to calls
        (``tool_calls.forced_calls_schema``)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)

    def named_tool(self) -> str | None:
        """The function ``tool_choice`` names, if it names one."""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Request, ChatFields):
    """vLLM's ``/tokenize``: a text prompt, tokenized as ``/v1/completions`` does, or a chat, rendered as
    ``/v1/chat/completions`` does."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None  # None: True for a prompt, False for a chat (its template has them)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        self.check_chat_fields_need(self.messages)
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


# ---- responses ---------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)  # always a list, as vLLM sends it
    reasoning: str | None = None  # with --reasoning-parser: what the model thought before answering
    reasoning_content: str | None = None  # the same, under its older name (vLLM keeps both)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    # vLLM's shape: per prompt token, None for the first, else {token id: {"logprob", "decoded_token"}} over
    # the token itself and its alternatives
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    system_fingerprint: str | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pat-engine"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- OpenAI Batch API lines ---------------------------------------------------------------------


class BatchRequestInput(_Request):
    custom_id: str
    method: Literal["POST"]
    url: Literal["/v1/chat/completions", "/v1/completions"]
    body: dict[str, Any]


class BatchResponseData(BaseModel):
    status_code: int = 200
    request_id: str
    body: dict[str, Any] | None = None


class BatchRequestOutput(BaseModel):
    id: str = Field(default_factory=lambda: random_id("batch_req"))
    custom_id: str | None
    response: BatchResponseData | None
    error: dict[str, Any] | None = None
