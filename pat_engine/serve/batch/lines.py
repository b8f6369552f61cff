"""Batch-file formats: parsing input lines, formatting result and error records, finding finished ids.

Two input styles, told apart per line:
- pat style: ``{"id": .., "prompt": "..."}`` or ``"messages": [..]`` or ``"input_ids": [..]``, with optional
  sampling fields (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``,
  ``stop_token_ids``, ``ignore_eos``, ``logprobs``, ``min_tokens``, ``n``, ``structured_outputs``) that
  override the command-line defaults, and with ``messages`` the chat endpoint's ``add_generation_prompt``,
  ``continue_final_message``, ``chat_template_kwargs`` and ``tools``; with ``n`` > 1 the record carries
  every sample under ``samples``;
- OpenAI Batch API: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
  "body": {...}}``, answered with OpenAI Batch output lines.

Either style may carry ``"metadata": {...}`` (any JSON object), handed to ``--reward`` with each answer;
with a reward the record adds each answer's reward (``reward_fields``), and a failed reward makes the
record an error that still carries the answers.

Every record carries a key (the line's ``id`` / ``custom_id``, else ``line-N``) so
``--resume`` can skip what a previous run already wrote.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, model_validator

from pat_engine.core.chat import ChatFields
from pat_engine.errors import InvalidRequestError, validation_message
from pat_engine.outputs import RequestOutput
from pat_engine.rollout.rewards import RewardResult
from pat_engine.sampling.options import to_sampling_params
from pat_engine.serve.async_engine import EngineInput
from pat_engine.serve.openai.protocol import (
    BatchRequestInput,
    BatchRequestOutput,
    BatchResponseData,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from pat_engine.serve.openai.answer_parsing import AnswerParsers, answer_parsers
from pat_engine.serve.openai.reasoning import think_tags
from pat_engine.serve.openai.translate import (
    chat_choice,
    chat_input,
    chat_prompt,
    completion_choice,
    completion_inputs,
    prompt_logprobs_entries,
    usage,
)

_OPENAI_KEYS = {"custom_id", "method", "url", "body"}


@dataclass(frozen=True)
class SamplingDefaults:
    """Command-line sampling options for pat-style lines (OpenAI lines use their body's own defaults)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: bool = False


class PatLine(ChatFields):  # with messages: the chat endpoint's fields shape the chat
    model_config = ConfigDict(extra="forbid")

    id: str | int | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[int] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    logprobs: bool | None = None
    min_tokens: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1)
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, json_object, regex, choice or grammar
    metadata: dict[str, Any] | None = None  # for --reward

    @model_validator(mode="after")
    def _one_prompt(self):
        given = [k for k in ("prompt", "messages", "input_ids") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt, messages, input_ids (got {', '.join(given) or 'none'})")
        self.check_chat_fields_need(self.messages)
        return self


@dataclass(frozen=True)
class BatchItem:
    line: int
    key: str
    input: EngineInput
    pat: PatLine | None = None
    openai: BatchRequestInput | None = None
    request: CompletionRequest | ChatCompletionRequest | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # the line's "metadata", for --reward
    parsers: AnswerParsers | None = None  # a chat line whose answer's reasoning or tool calls are parsed out

    def error(self, message: str, status: int = 400) -> "LineError":
        """This line's error record, in its own style."""
        return LineError(self.line, message, key=self.key, openai=self.openai is not None,
                         custom_id=self.openai.custom_id if self.openai else None, status=status)


class LineError(Exception):
    """A line that cannot be run; becomes an error record naming the line and the problem."""

    def __init__(self, line: int, message: str, key: str | None = None, openai: bool = False,
                 custom_id: str | None = None, status: int = 400):
        super().__init__(f"line {line}: {message}")
        self.line, self.key, self.openai, self.custom_id, self.status = line, key or f"line-{line}", openai, custom_id, status


def is_openai_line(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(_OPENAI_KEYS & obj.keys())


def parse_line(line: int, obj: Any, tokenizer: Any, max_model_len: int, defaults: SamplingDefaults,
               tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> BatchItem:
    """Validate one decoded JSON line into something the engine can run; raises ``LineError``.
    ``tool_call_parser``, ``reasoning_parser``: the job's, for the answers of OpenAI chat lines."""
    if is_openai_line(obj):
        return _parse_openai(line, obj, tokenizer, max_model_len, tool_call_parser, reasoning_parser)
    if not isinstance(obj, dict):
        raise LineError(line, f"expected a JSON object, got {type(obj).__name__}")
    key = f"line-{line}" if obj.get("id") is None else str(obj["id"])
    try:
        pat = PatLine.model_validate(obj)
    except ValidationError as exc:
        raise LineError(line, validation_message(exc), key=key) from None
    try:
        chat_fields = set(ChatFields.model_fields)
        options = pat.model_dump(exclude={"id", "prompt", "messages", "input_ids", "metadata", *chat_fields})
        params = to_sampling_params(options, defaults=asdict(defaults))
        rendered: str | None = None
        prompt: Any
        if pat.messages is not None:
            prompt, rendered = chat_prompt(tokenizer, pat.messages, pat.chat_options(), max_model_len)
        else:
            prompt = pat.prompt if pat.prompt is not None else pat.input_ids
    except InvalidRequestError as exc:
        raise LineError(line, str(exc), key=key) from None
    return BatchItem(line, key, EngineInput(prompt, params, rendered), pat=pat, metadata=pat.metadata or {})


def _parse_openai(line: int, obj: dict, tokenizer: Any, max_model_len: int, tool_call_parser: str | None,
                  reasoning_parser: str | None) -> BatchItem:
    cid = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
    err = dict(openai=True, custom_id=cid, key=cid)
    obj = dict(obj)
    metadata = obj.pop("metadata", None)  # pat's addition to the OpenAI line, for --reward
    if metadata is not None and not isinstance(metadata, dict):
        raise LineError(line, f"metadata must be a JSON object, got {type(metadata).__name__}", **err)
    try:
        req_line = BatchRequestInput.model_validate(obj)
        model = ChatCompletionRequest if req_line.url == "/v1/chat/completions" else CompletionRequest
        req = model.model_validate(req_line.body)
    except ValidationError as exc:
        raise LineError(line, validation_message(exc), **err) from None
    if req.stream:
        raise LineError(line, "body.stream: a batch request must not be sent in stream mode", **err)
    parsers = None
    try:
        if isinstance(req, ChatCompletionRequest):
            parsers = answer_parsers(req, tool_call_parser, reasoning_parser)
            inp = chat_input(req, tokenizer, max_model_len, think_tags(reasoning_parser))
        else:
            inputs = completion_inputs(req)
            if len(inputs) != 1:
                raise InvalidRequestError("body.prompt: a batch line takes one prompt")
            inp = inputs[0]
    except InvalidRequestError as exc:
        raise LineError(line, str(exc), **err) from None
    return BatchItem(line, req_line.custom_id, inp, openai=req_line, request=req, metadata=metadata or {},
                     parsers=parsers)


# ---- output records ------------------------------------------------------------------------------


def result_record(item: BatchItem, outs: list[RequestOutput], tokenizer: Any, model: str,
                  rewards: list[RewardResult] | None = None) -> dict:
    """The output line of one input line; ``outs``: its samples (one unless it asked for n > 1), ``rewards``
    their rewards in the same order (with ``--reward``)."""
    failed = [o for o in outs if o.finish_reason == "error"]
    if failed:
        return error_record(item.error(f"generation failed: {failed[0].error}", status=500))
    if item.openai is None:
        fields = reward_fields(rewards)
        samples = [{**_pat_sample(o), **f} for o, f in zip(outs, fields or [{}] * len(outs))]
        rec = {"id": item.pat.id if item.pat.id is not None else item.key, "line": item.line,
               **samples[0], "usage": usage(outs).model_dump(exclude={"prompt_tokens_details"})}
        if len(outs) > 1:
            rec["samples"] = samples
        rec["error"] = _reward_error(item, rewards)
        return rec
    req = item.request
    if isinstance(req, ChatCompletionRequest):
        choices = [chat_choice(i, o, req, tokenizer, item.parsers) for i, o in enumerate(outs)]
        body = ChatCompletionResponse(model=model, choices=choices, usage=usage(outs),
                                      prompt_logprobs=prompt_logprobs_entries(outs[0], tokenizer))
    else:
        choices = [completion_choice(i, o, req, tokenizer) for i, o in enumerate(outs)]
        body = CompletionResponse(model=model, choices=choices, usage=usage(outs))
    response = BatchResponseData(status_code=200, request_id=random_id("pat-batch"), body=body.model_dump())
    rec = BatchRequestOutput(custom_id=item.openai.custom_id, response=response).model_dump()
    if rewards is not None:  # one per choice, by index
        fields = reward_fields(rewards)
        rec["rewards"] = [f["reward"] for f in fields]
        if any("reward_info" in f for f in fields):
            rec["reward_info"] = [f.get("reward_info", {}) for f in fields]
        message = _reward_error(item, rewards)
        if message is not None:  # the answers stay in "response"; the line still reports the failure
            rec["error"] = {"message": message, "type": "RewardError", "param": None, "code": 500, "line": item.line}
    return rec


def reward_fields(rewards: list[RewardResult] | None) -> list[dict] | None:
    """Per answer: ``{"reward": float or null, "reward_info": {...} when the reward returned more}``."""
    if rewards is None:
        return None
    return [{"reward": r.reward, **({"reward_info": r.info} if r.info else {})} for r in rewards]


def _reward_error(item: BatchItem, rewards: list[RewardResult] | None) -> str | None:
    """The line's error when a reward failed: the first failure, named by its answer's index."""
    bad = [(i, r) for i, r in enumerate(rewards or []) if not r.ok]
    if not bad:
        return None
    i, r = bad[0]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return f"line {item.line}: reward of answer {i} failed: {r.error}{more}"


def error_record(err: LineError) -> dict:
    message = str(err)
    if not err.openai:
        return {"id": err.key, "line": err.line, "error": message}
    info = {"message": message, "type": "BadRequestError" if err.status == 400 else "InternalServerError",
            "param": None, "code": err.status, "line": err.line}
    response = BatchResponseData(status_code=err.status, request_id=random_id("pat-batch"), body=None)
    return BatchRequestOutput(custom_id=err.custom_id, response=response, error=info).model_dump()


def record_key(rec: dict) -> str | None:
    """The key a record was written under (see the module docstring)."""
    if "custom_id" in rec:
        if rec["custom_id"] is not None:
            return str(rec["custom_id"])
        line = (rec.get("error") or {}).get("line")
        return f"line-{line}" if line is not None else None
    return None if rec.get("id") is None else str(rec["id"])


def finished_keys(path: Path) -> set[str]:
    """Keys already in an output file; a torn last line (the run was killed mid-write) is cut off."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("r+b") as f:
            f.truncate(end)
    keys = set()
    for raw in data[:end].splitlines():
        try:
            key = record_key(json.loads(raw))
        except (json.JSONDecodeError, AttributeError, TypeError):
            continue
        if key is not None:
            keys.add(key)
    return keys


def _pat_sample(out: RequestOutput) -> dict:
    rec = {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}
    if out.stop_reason is not None:
        rec["stop_reason"] = out.stop_reason
    if out.logprobs is not None:
        rec["logprobs"] = out.logprobs
    return rec
