"""vLLM's tokenizer routes: ``/tokenize`` (a prompt or a chat to the token ids the generation routes would
run), ``/detokenize`` and ``/version``. Agent loops use them to count a context or to splice turns as ids.

The ids come from the same code the generation routes use (``RequestFactory.tokenize``, ``core/chat.py``),
so ``count`` is the ``prompt_tokens`` a completion of the same input reports, and the same limits apply.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from pat_engine.core.chat import chat_prompt
from pat_engine.errors import InvalidRequestError
from pat_engine.serve.openai.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from pat_engine.serve.state import State
from pat_engine.version import __version__

router = APIRouter()


def _tokenizer(pat: State):
    if pat.engine.tokenizer is None:
        raise InvalidRequestError("the model has no tokenizer: there is nothing to tokenize or detokenize with")
    return pat.engine.tokenizer


@router.post("/tokenize")
async def tokenize(request: Request, pat: State) -> dict:
    req = await pat.parse(request, TokenizeRequest)
    pat.check_model(req.model)
    return await asyncio.to_thread(_tokenize, req, pat.engine, _tokenizer(pat))  # off the event loop


def _tokenize(req: TokenizeRequest, engine: Any, tokenizer: Any) -> dict:
    if req.messages is not None:
        ids, text = chat_prompt(tokenizer, req.messages, req.chat_options(), engine.max_model_len)
        if req.add_special_tokens:  # asked for: the rendered chat with the tokenizer's own specials as well
            ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
        ids, _ = engine.request_factory.tokenize(ids, "")  # the context and vocabulary checks a chat gets
    else:
        ids, _ = engine.request_factory.tokenize(req.prompt, "", add_special_tokens=req.add_special_tokens is not False)
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids,
                            token_strs=strs).model_dump()


@router.post("/detokenize")
async def detokenize(request: Request, pat: State) -> dict:
    req = await pat.parse(request, DetokenizeRequest)
    pat.check_model(req.model)
    tokenizer = _tokenizer(pat)
    # the ids a prompt may hold: inside the vocabulary and the context (what bounds the text decoded)
    ids = pat.engine.request_factory.tokenize(req.tokens, "tokens")[0] if req.tokens else []
    text = await asyncio.to_thread(tokenizer.decode, ids)  # off the event loop
    return DetokenizeResponse(prompt=text).model_dump()


@router.get("/version")
async def version() -> dict:
    return {"version": __version__}
