"""Between SGLang's ``/generate`` body and the engine: prompts and sampling parameters in, SGLang's
response objects (``text``, ``output_ids``, ``meta_info``) out.

Sampling parameters go through pat-engine's one translator (``pat_engine.sampling.options``:
SGLang's names, e.g. ``sampling_seed`` and ``no_stop_trim``, are aliases there, and its
``REFUSED`` table says which sampling fields pat-engine lacks; ``UNSUPPORTED_SAMPLING`` is
the part of it SGLang's schema has). Request fields pat-engine does not support are listed in
``UNSUPPORTED_REQUEST`` (field -> the values that mean "off"). A request that turns one on
gets a 400 naming the field.

Exact partial-rollout resume: a draw depends only on ``(sampling_seed, absolute
position)``, where the position counts from the first prompt token. Resubmitting
``prompt + generated`` as the new prompt with the same ``sampling_seed`` and
``max_new_tokens`` lowered by ``len(generated)`` gives exactly the tokens the
uninterrupted request would have given next (docs/pat-serve.md).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import ValidationError

from pat_engine.sampling import options as sampling_options
from pat_engine.core.request_handle import RequestHandle, RequestProgress
from pat_engine.errors import InvalidRequestError, validation_message
from pat_engine.sampling.options import REFUSED
from pat_engine.sampling.params import SamplingParams
from pat_engine.serve.sglang.protocol import GenerateRequest, SGLSamplingParams
from pat_engine.serve.async_engine import EngineInput

UNSUPPORTED_SAMPLING = {name: off for name, off in REFUSED.items() if name in SGLSamplingParams.model_fields}
UNSUPPORTED_REQUEST: dict[str, tuple] = {
    "token_ids_logprob": (None,),
    "return_hidden_states": (False,),
    "input_embeds": (None,),
    "image_data": (None,),
    "video_data": (None,),
    "audio_data": (None,),
    "modalities": (None, []),
    "session_params": (None,),
    "lora_path": (None,),
    "custom_logit_processor": (None,),
    "bootstrap_host": (None,),
    "bootstrap_port": (None,),
    "bootstrap_room": (None,),
    "return_bytes": (None, False),
    "return_entropy": (None, False),
}


@dataclass(frozen=True)
class GenerateItem:
    """One prompt of a ``/generate`` call, ready for the engine, with what its response needs."""

    rid: str
    input: EngineInput
    return_logprob: bool
    logprob_start_len: int
    return_text_in_logprobs: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    stop_token_ids: tuple[int, ...]


def _refuse_unsupported(obj: Any, table: dict[str, tuple], where: str) -> None:
    for name, off in table.items():
        value = getattr(obj, name)
        if value not in off:
            raise InvalidRequestError(f"{where}{name}={value!r} is not supported by pat-engine yet")


def to_sampling_params(sp: SGLSamplingParams, return_logprob: bool, where: str = "", top_logprobs: int = 0,
                       prompt_logprobs: int | None = None) -> SamplingParams:
    options = {**sp.model_dump(), "logprobs": return_logprob, "top_logprobs": top_logprobs if return_logprob else 0,
               "prompt_logprobs": prompt_logprobs}
    # logprobs under the distribution sampled from, as SGLang reports them
    return sampling_options.to_sampling_params(options, logprobs_mode="processed", where=f"{where}sampling_params.")


def parse_sampling_params(raw: dict[str, Any], where: str = "") -> SGLSamplingParams:
    try:
        return SGLSamplingParams.model_validate(raw)
    except ValidationError as exc:
        raise InvalidRequestError(validation_message(exc, prefix="sampling_params.", unknown="unknown field '{loc}'",
                                                     where=where)) from None


def _per_item(value: Any, n: int, name: str, default: Any) -> list:
    """A field given once for the whole batch or once per prompt."""
    if isinstance(value, list):
        if len(value) != n:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {n} prompts")
        return [default if v is None else v for v in value]
    return [default if value is None else value] * n


def generate_items(req: GenerateRequest, room: Callable[[Any], int]) -> tuple[list[GenerateItem], bool]:
    """The prompts of one ``/generate`` body and whether it was a batch (the response is then a list).

    ``room(prompt)``: how many tokens the context leaves after ``prompt`` (for ``max_new_tokens: null``)."""
    if (req.text is None) == (req.input_ids is None):
        raise InvalidRequestError("give exactly one of text or input_ids")
    _refuse_unsupported(req, UNSUPPORTED_REQUEST, "")
    if req.text is not None:
        batch = isinstance(req.text, list)
        prompts: list = list(req.text) if batch else [req.text]
    else:
        batch = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        prompts = [list(p) for p in req.input_ids] if batch else [list(req.input_ids)]
    n = len(prompts)
    if n == 0:
        raise InvalidRequestError("empty batch: no prompt given")
    if batch and isinstance(req.rid, str):
        raise InvalidRequestError("a batch needs rid as a list (one per prompt) or none")
    rids = _per_item(req.rid, n, "rid", None)
    rids = [r or uuid.uuid4().hex for r in rids]
    if len(set(rids)) != n:
        raise InvalidRequestError("rid values must be unique within a batch")
    sps = _per_item(req.sampling_params, n, "sampling_params", {})
    logprob = _per_item(req.return_logprob, n, "return_logprob", False)
    starts = _per_item(req.logprob_start_len, n, "logprob_start_len", -1)
    tops = _per_item(req.top_logprobs_num, n, "top_logprobs_num", 0)
    items = []
    for i in range(n):
        where = f"prompt {i}: " if batch else ""
        sp = parse_sampling_params(sps[i], where)
        if sp.max_new_tokens is None:  # SGLang: as many as the context leaves
            sp = sp.model_copy(update={"max_new_tokens": room(prompts[i])})
        prompt_lp = tops[i] if logprob[i] and starts[i] != -1 else None  # input_token_logprobs from start
        params = to_sampling_params(sp, logprob[i], where, tops[i], prompt_lp)
        items.append(GenerateItem(rids[i], EngineInput(prompts[i], params), logprob[i], starts[i],
                                  req.return_text_in_logprobs, sp.skip_special_tokens, sp.no_stop_trim,
                                  tuple(sp.stop_token_ids or ())))
    return items, batch


# ---- outputs -----------------------------------------------------------------------------------


def finish_reason(snap: RequestProgress) -> dict | None:
    """SGLang's ``meta_info["finish_reason"]``: ``{"type": "stop", "matched": id}``, ``{"type": "length",
    "length": n}`` or ``{"type": "abort", "message": ...}``; None while the request runs."""
    reason = snap.finish_reason
    if reason is None:
        return None
    if reason == "stop":
        matched = snap.stop_reason if snap.stop_reason is not None else (snap.token_ids[-1] if snap.token_ids else None)
        return {"type": "stop", "matched": matched}
    if reason == "length":
        return {"type": "length", "length": len(snap.token_ids)}
    status = 500 if reason == "error" else None
    return {"type": "abort", "message": snap.error or "aborted", "status_code": status,
            "err_type": "InternalServerError" if status else None}


def _text(tokenizer: Any, ids: list[int], skip_special: bool) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special) if tokenizer is not None else ""


def response_object(item: GenerateItem, handle: RequestHandle, tokenizer: Any) -> dict:
    """One prompt's SGLang response as it stands (cumulative: SGLang's default streaming form too)."""
    snap = handle.snapshot()
    ids = snap.token_ids
    fr = finish_reason(snap)
    stop_matched = fr is not None and fr["type"] == "stop" and ids and not isinstance(snap.stop_reason, str)
    text_ids = ids[:-1] if stop_matched and not item.no_stop_trim else ids
    out = handle.output(with_text=False)
    end = out.metrics.get("finish_time") or time.time()
    spans = snap.weight_versions
    meta: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": fr,
        "prompt_tokens": len(snap.prompt_token_ids),
        "completion_tokens": len(ids),
        "cached_tokens": out.metrics.get("cached_tokens", 0),  # prompt tokens found in the prefix cache
        "weight_version": spans[-1][0] if spans else None,
        "weight_versions": [{"version": v, "start": s, "end": e} for v, s, e in spans],
        "e2e_latency": end - out.metrics["arrival_time"],
        "num_retractions": out.metrics.get("preemptions", 0),
    }
    if item.return_logprob:
        lps = snap.logprobs or []
        texts = [_text(tokenizer, [t], False) if item.return_text_in_logprobs else None for t in ids]
        meta["output_token_logprobs"] = [[lp, t, tx] for lp, t, tx in zip(lps, ids, texts)]
        if snap.top_logprobs is not None:
            meta["output_top_logprobs"] = [[[v, a, _text(tokenizer, [a], False) if item.return_text_in_logprobs
                                             else None] for a, v in alts] for alts in snap.top_logprobs]
        meta["input_token_logprobs"] = _input_logprobs(item, out, tokenizer)
    text = snap.text if snap.text is not None else _text(tokenizer, text_ids, item.skip_special_tokens)
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


def _input_logprobs(item: GenerateItem, out: Any, tokenizer: Any) -> list:
    """``[logprob, id, text]`` of the prompt tokens from ``logprob_start_len`` (the first token's is None)."""
    if item.logprob_start_len == -1 or out.prompt_logprobs is None:
        return []
    start = max(item.logprob_start_len, 0)
    ids = out.prompt_token_ids
    return [[out.prompt_logprobs[j], ids[j], _text(tokenizer, [ids[j]], False) if item.return_text_in_logprobs
             else None] for j in range(start, len(ids))]
