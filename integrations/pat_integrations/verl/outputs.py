"""What veRL reads from a generation: the ``TokenOutput`` its vLLM server fills.

- ``token_ids`` / ``log_probs``: the response. veRL's vLLM server returns only
  ``outputs[0]``; with ``n`` > 1 these are sample 0's, and every sample (sample 0
  first) is under ``extra_fields["samples"]`` as ``{"token_ids", "log_probs", "stop_reason"}``;
- ``stop_reason``: "aborted" or "completed";
- ``extra_fields``: ``global_steps``, ``num_cached_tokens`` (prompt tokens found in
  the prefix cache) and, with ``prompt_logprobs``, ``prompt_ids`` / ``prompt_logprobs``
  laid out as veRL's ``extract_prompt_logprobs`` lays them out (its distillation
  teacher reads them).
"""

from __future__ import annotations

from typing import Any

from verl.workers.rollout.replica import TokenOutput

from pat_engine import RequestOutput


def prompt_logprob_fields(out: RequestOutput, k: int) -> dict[str, list]:
    """One row per prompt token after the first (``k`` = 0: that token's id and log-prob; else the
    ``k`` most likely ids and log-probs at its position), then a dummy row for the last position."""
    ids, logprobs = [], []
    for j in range(1, len(out.prompt_token_ids)):
        if k == 0:
            ids.append([out.prompt_token_ids[j]])
            logprobs.append([out.prompt_logprobs[j]])
        else:
            top = out.prompt_top_logprobs[j]
            ids.append([t for t, _ in top])
            logprobs.append([v for _, v in top])
    width = max(k, 1)
    return {"prompt_ids": ids + [[0] * width], "prompt_logprobs": logprobs + [[0.0] * width]}


def _stop_reason(out: RequestOutput) -> str:
    return "aborted" if out.finish_reason == "abort" else "completed"


def token_output(out: RequestOutput | None, prompt_logprobs: int | None, global_steps: int | None,
                 sample_index: int | None = None) -> TokenOutput:
    """``out``: None when the admission gate rejected the request (the client re-routes aborted ones);
    ``sample_index``: a tail-batched round's response index within its prompt, kept in ``extra_fields``."""
    extra: dict[str, Any] = {"global_steps": global_steps}
    if sample_index is not None:
        extra["sample_index"] = sample_index
    if out is None:
        return TokenOutput(token_ids=[], stop_reason="aborted", extra_fields=extra)
    extra["num_cached_tokens"] = out.metrics.get("cached_tokens", 0)
    if prompt_logprobs is not None and out.prompt_logprobs is not None:
        extra.update(prompt_logprob_fields(out, prompt_logprobs))
    if out.samples:
        extra["samples"] = [{"token_ids": s.token_ids, "log_probs": s.logprobs, "stop_reason": _stop_reason(s)}
                            for s in out.samples]
    return TokenOutput(
        token_ids=out.token_ids,
        log_probs=out.logprobs,
        stop_reason=_stop_reason(out),
        num_preempted=out.metrics.get("preemptions"),
        extra_fields=extra,
    )
