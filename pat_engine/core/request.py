"""Driver-side state of one request while it is generated."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

from pat_engine.outputs import RequestOutput
from pat_engine.sampling.sampler import SamplingSpec
from pat_engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # no KV: not yet prefilled, or preempted, or moved by recompute
    RUNNING = "running"  # KV cached for tokens[:num_cached]
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    spec: SamplingSpec
    eos_ids: tuple[int, ...]
    max_len: int  # prompt + output may not exceed this (context limit)
    prompt: str | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    group: int = -1
    block_table: list[int] = field(default_factory=list)
    blocks_sent: int = 0  # how many table entries the workers already know
    num_cached: int = 0
    finish_reason: str | None = None
    error: str | None = None
    preemptions: int = 0
    arrival_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    finish_time: float | None = None
    on_update: Callable[["Sequence", int], None] | None = None  # called with the number of new tokens
    # (first output index, weight version): the weights that produced each token from there on
    weight_versions: list[tuple[int, str]] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def forget_kv(self) -> None:
        """The KV this sequence had is gone (freed, or left in a pool that no longer exists)."""
        self.block_table, self.blocks_sent, self.num_cached = [], 0, 0

    def outstanding_tokens(self) -> int:
        """Work left: uncached context to prefill plus tokens still to generate."""
        return (self.length - self.num_cached) + (self.params.max_new_tokens - len(self.output_ids))

    def append_token(self, token: int, logprob: float | None) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self.output_ids.append(token)
        if logprob is not None and self.params.logprobs:
            self.logprobs.append(logprob)
        n, p = len(self.output_ids), self.params
        if not p.ignore_eos and token in self.eos_ids and n >= p.min_new_tokens:
            self.finish("stop")
        elif token in p.stop_token_ids and n >= p.min_new_tokens:
            self.finish("stop")
        elif n >= p.max_new_tokens or self.length >= self.max_len:
            self.finish("length")

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        self.finish_time = time.time()

    def weight_version_spans(self, num_tokens: int) -> list[tuple[str, int, int]]:
        """``(version, start, end)`` over the first ``num_tokens`` output tokens (SGLang's
        ``meta_info["weight_versions"]``); a version that produced no token is left out, except the
        one the request started under when it has produced nothing yet."""
        spans: list[tuple[str, int, int]] = []
        points = list(self.weight_versions)
        for i, (start, version) in enumerate(points):
            end = points[i + 1][0] if i + 1 < len(points) else num_tokens
            start, end = min(start, num_tokens), min(end, num_tokens)
            if end > start or (not spans and i == len(points) - 1):
                if spans and spans[-1][0] == version:
                    spans[-1] = (version, spans[-1][1], end)
                else:
                    spans.append((version, start, end))
        return spans

    def suppressed_now(self) -> tuple[int, ...]:
        """Token ids the next draw may not take (EOS and stop ids before min_new_tokens)."""
        if len(self.output_ids) >= self.params.min_new_tokens:
            return ()
        return tuple(self.eos_ids) + self.params.stop_token_ids if not self.params.ignore_eos else self.params.stop_token_ids

    def to_output(self, decode: Callable[[list[int]], str] | None, token_ids: list[int], finish_reason: str | None,
                  error: str | None) -> RequestOutput:
        """The request's output with its first ``len(token_ids)`` tokens (a caller's consistent snapshot)."""
        n = len(token_ids)
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_ids),
            token_ids=token_ids,
            text=decode(token_ids) if decode else None,
            finish_reason=finish_reason,
            logprobs=list(self.logprobs[:n]) if self.params.logprobs else None,
            prompt=self.prompt,
            error=error,
            metrics={
                "arrival_time": self.arrival_time,
                "first_token_time": self.first_token_time,
                "finish_time": self.finish_time,
                "preemptions": self.preemptions,
            },
        )
