"""Cost-aware admission for the adapters: predicted lengths learned per prompt across steps.

RL frameworks send one request at a time and own the prompts and group sizes, so of the
rollout layer only placement fits inside an adapter (docs/rollout.md says why). Each
prompt is keyed by its token ids; the lengths its responses reached in earlier steps
predict the next ones (unknown prompts: the mean so far, else the request's max_tokens),
and ``pat_engine.rollout.placement.AdmissionPlacement`` puts each request on the DP
group with the least predicted remaining cost as it is admitted (online greedy).
"""

from __future__ import annotations

import hashlib
from typing import Any

from pat_engine.outputs import RequestOutput
from pat_engine.rollout.length_history import LengthHistory
from pat_engine.rollout.placement import AdmissionPlacement
from pat_engine.sampling_params import SamplingParams


def prompt_key(prompt: Any) -> int:
    digest = hashlib.blake2b(repr(prompt).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class LearnedPlacement:
    def __init__(self) -> None:
        self.history = LengthHistory(default=0.0)
        self.hook = AdmissionPlacement()
        self._known = False

    def expect(self, request_id: str, prompt: Any, params: SamplingParams) -> None:
        """Before ``submit``: tell the hook what this request is predicted to cost."""
        guess = self.history.predict(prompt_key(prompt)) if self._known else params.max_new_tokens
        self.hook.expect(request_id, min(max(guess, 1.0), params.max_new_tokens))

    def record(self, prompt: Any, out: RequestOutput) -> None:
        """After it finished: learn the lengths of its samples (only of those that ran to their end)."""
        self.hook.forget([out.request_id])
        lengths = [len(s.token_ids) for s in (out.samples or [out]) if s.finish_reason in ("stop", "length")]
        if lengths:
            self.history.record(prompt_key(prompt), lengths)
            self._known = True
