"""Exact resumption of a partial output (the convention docs/rollout.md states).

Every sampling draw depends only on (seed, absolute token position), so submitting
prompt + the k tokens generated so far, with the same explicit seed, ``max_new_tokens``
reduced by k and ``min_new_tokens`` reduced by k (not below 0), continues exactly as
the uninterrupted request would have. Only valid under the weights the partial was
generated with; a stale partial is regenerated from the prompt instead.

Some parameters look at the response as such, which the continuation sees as prompt:
stop strings (matched in the response text), frequency and presence penalties (counted
over the response), structured output (its grammar starts where the response starts), top
and prompt log-probabilities (not carried by the partial). A request using them is not
resumed but run again from its prompt with the same seed, which is exact too, only slower
(``exactly_resumable``).
"""

from __future__ import annotations

import dataclasses

from pat_engine.errors import InvalidRequestError
from pat_engine.outputs import RequestOutput
from pat_engine.sampling.params import SamplingParams


def exactly_resumable(params: SamplingParams) -> bool:
    """Whether continuing from a partial gives what the uninterrupted request gives (module docstring)."""
    return (not params.stop and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0
            and not (params.logprobs and params.top_logprobs) and params.prompt_logprobs is None
            and params.structured_output is None)


def resume_request(prompt_ids: list[int], generated: list[int],
                   params: SamplingParams) -> tuple[list[int], SamplingParams]:
    """The prompt and parameters that continue a request which generated ``generated`` so far."""
    if params.seed is None and not params.greedy:
        raise InvalidRequestError("exact resumption needs an explicit sampling seed")
    k = len(generated)
    if k >= params.max_new_tokens:
        raise InvalidRequestError(f"nothing left to resume: {k} tokens of {params.max_new_tokens} generated")
    rest = dataclasses.replace(params, max_new_tokens=params.max_new_tokens - k,
                               min_new_tokens=max(params.min_new_tokens - k, 0))
    return list(prompt_ids) + list(generated), rest


def join_outputs(prompt_ids: list[int], generated: list[int], logprobs: list[float] | None,
                 rest: RequestOutput) -> RequestOutput:
    """One output as if never interrupted: the partial's tokens, then the continuation's."""
    lp = None
    if logprobs is not None and rest.logprobs is not None:
        lp = list(logprobs) + list(rest.logprobs)
    return dataclasses.replace(rest, prompt_token_ids=list(prompt_ids), token_ids=list(generated) + list(rest.token_ids),
                               logprobs=lp, text=None)
