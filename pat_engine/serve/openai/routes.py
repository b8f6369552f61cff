"""The OpenAI-compatible routes: completions, chat completions and the model list.

Bodies are parsed by ``ServerState.parse`` rather than by FastAPI, so every failure
(content type, JSON syntax, schema, size) comes back as a 4xx in the OpenAI error shape.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pat_engine.serve.openai.answer_parsing import answer_parsers
from pat_engine.serve.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    random_id,
)
from pat_engine.serve.openai.reasoning import think_tags
from pat_engine.serve.openai.streams import chat_stream, completion_stream
from pat_engine.serve.openai.translate import (
    chat_choice,
    chat_input,
    completion_choice,
    completion_inputs,
    prompt_logprobs_entries,
    usage,
)
from pat_engine.serve.sse import event_stream
from pat_engine.serve.state import State

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request, pat: State) -> Response:
    req = await pat.parse(request, CompletionRequest)
    pat.check_model(req.model)
    rid = random_id("cmpl")
    group = await pat.submit(completion_inputs(req), rid)
    tokenizer = pat.engine.tokenizer
    if req.stream:
        return event_stream(completion_stream(group, req, tokenizer, pat.model, rid))
    outs = await pat.collect(group, request)
    resp = CompletionResponse(id=rid, model=pat.model, usage=usage(outs),
                              choices=[completion_choice(i, o, req, tokenizer) for i, o in enumerate(outs)])
    return JSONResponse(resp.model_dump())


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, pat: State) -> Response:
    req = await pat.parse(request, ChatCompletionRequest)
    pat.check_model(req.model)
    rid = random_id("chatcmpl")
    engine = pat.engine
    parsers = answer_parsers(req, pat.config.tool_call_parser, pat.config.reasoning_parser)
    # rendering and tokenizing a long chat takes a while: off the event loop, which serves every stream
    inp = await asyncio.to_thread(chat_input, req, engine.tokenizer, engine.max_model_len,  # over-long: refused
                                  think_tags(pat.config.reasoning_parser))
    group = await pat.submit([inp], rid)
    if req.stream:
        return event_stream(chat_stream(group, req, engine.tokenizer, pat.model, rid, parsers))
    outs = await pat.collect(group, request)
    choices = [chat_choice(i, o, req, engine.tokenizer, parsers) for i, o in enumerate(outs)]
    resp = ChatCompletionResponse(id=rid, model=pat.model, usage=usage(outs), choices=choices,
                                  prompt_token_ids=list(outs[0].prompt_token_ids) if req.return_token_ids else None,
                                  prompt_logprobs=prompt_logprobs_entries(outs[0], engine.tokenizer))
    return JSONResponse(resp.model_dump())


@router.get("/v1/models")
async def models(pat: State) -> dict:
    card = ModelCard(id=pat.model, root=pat.engine.config.model, max_model_len=pat.engine.max_model_len)
    return ModelList(data=[card]).model_dump()
