"""veRL's partial-rollout contract, made exact on a pat-engine server.

veRL 0.9's partial rollout (``FullyAsyncLLMServerClient``, used by its async trainers)
works per request: ``abort_all_requests`` makes the server answer every running request
with what it generated so far (``stop_reason="aborted"``); after ``resume_generation`` the
client sends it again as ``prompt_ids + tokens so far`` with the same sampling dict and
``max_tokens`` lowered by what it has, and appends the answer. The client sends no seed and
leaves ``min_tokens`` as it was, so a plain server continues with fresh randomness.

``PartialLedger`` closes that gap with ``pat_engine.rollout.resume``: every request the
server runs gets an explicit seed (derived from the server's seed and the request id when it
names none); an aborted answer is recorded under the token sequence the client will send
back; a request arriving with exactly that sequence continues the recorded request
(``resume_request``: same seed, budgets lowered), so the joined response equals the
uninterrupted one when the weights did not change in between. Requests whose options read
the response itself (``resume.exactly_resumable``) are continued as the client asks, not exactly.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pat_engine.outputs import RequestOutput
from pat_engine.rollout.resume import exactly_resumable, resume_request
from pat_engine.rollout.runner import derived_seed
from pat_engine.sampling.params import SamplingParams


@dataclass(frozen=True)
class Origin:
    """The request a generate call continues: its first prompt, tokens before this call, parameters."""

    prompt_ids: tuple[int, ...]
    generated: tuple[int, ...]
    params: SamplingParams


class PartialLedger:
    def __init__(self, seed: int, capacity: int = 1 << 16):
        self.seed = seed
        self.capacity = capacity  # open partials kept; the oldest go first (their client gave up)
        self._open: OrderedDict[tuple[int, ...], Origin] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def prepare(self, prompt_ids: list[int], params: SamplingParams, request_id: Any) -> tuple[SamplingParams, Origin]:
        """The parameters to run this call with, and the request it belongs to."""
        origin = self._open.pop(tuple(prompt_ids), None)
        if origin is not None and exactly_resumable(origin.params) \
                and len(origin.generated) < origin.params.max_new_tokens:
            _, rest = resume_request(list(origin.prompt_ids), list(origin.generated), origin.params)
            return rest, origin
        if params.seed is None and not params.greedy:  # pinned, so that a resume can reuse it
            params = dataclasses.replace(params, seed=derived_seed(self.seed, request_id, tuple(prompt_ids)))
        return params, Origin(tuple(prompt_ids), (), params)

    def settle(self, origin: Origin, out: RequestOutput | None) -> None:
        """After the call: an aborted single-sample answer is kept for the client's resubmission."""
        if out is None or out.finish_reason != "abort" or out.samples or origin.params.n != 1:
            return
        generated = origin.generated + tuple(out.token_ids)
        self._open[origin.prompt_ids + generated] = Origin(origin.prompt_ids, generated, origin.params)
        while len(self._open) > self.capacity:
            self._open.popitem(last=False)
