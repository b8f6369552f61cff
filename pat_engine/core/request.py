"""Driver-side state of one request while it is generated."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from pat_engine.core.stop_strings import StopStringMatcher
from pat_engine.outputs import RequestOutput
from pat_engine.protocol import PromptLogprobs
from pat_engine.sampling.spec import SamplingSpec
from pat_engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from pat_engine.core.grammar import GrammarState
    from pat_engine.protocol import TokenMask


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
    sampling: SamplingSpec  # what the workers need to sample it
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
    sample_index: int = 0  # which of the n samples of its prompt
    first_sample: "Sequence | None" = None  # sample 0 of the same prompt, when this is a later sample
    blocks_registered: int = 0  # leading blocks of the table already indexed in the prefix cache
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    arrival_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    finish_time: float | None = None
    on_update: Callable[["Sequence", int], None] | None = None  # called with the number of new tokens
    stop_strings: StopStringMatcher | None = None  # detokenizes the response when it has stop strings
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per output token, when asked
    prompt_logprobs: PromptLogprobs | None = None  # when asked, from the first prefill of the whole prompt
    # (first output index, weight version): the weights that produced each token from there on
    weight_versions: list[tuple[int, str]] = field(default_factory=list)
    grammar: "GrammarState | None" = None  # structured output: where the answer is in its grammar

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        """The newest token, without building ``tokens`` (a decode step needs only this one)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def forget_kv(self) -> None:
        """The KV this sequence had is gone (freed, or left in a pool that no longer exists)."""
        self.block_table, self.blocks_sent, self.num_cached, self.blocks_registered = [], 0, 0, 0

    def waits_for_sibling(self) -> bool:
        """A later sample waits until sample 0 of its prompt has been prefilled, then shares its blocks."""
        first = self.first_sample
        return first is not None and not first.finished and first.num_cached == 0 and first.group == self.group

    def prefix_namespace(self, caching: bool) -> int | None:
        """Where this sequence's full blocks are indexed: the shared prefix cache (None) when caching is
        on; otherwise its prompt's own namespace, so its samples still share the prompt."""
        if caching:
            return None
        first = self.first_sample or self
        return first.seq_id if (self.first_sample is not None or self.params.n > 1) else None

    def outstanding_tokens(self) -> int:
        """Work left: uncached context to prefill plus tokens still to generate."""
        return (self.length - self.num_cached) + (self.params.max_new_tokens - len(self.output_ids))

    def wants_prompt_logprobs(self) -> bool:
        """Sample 0 of a request asking for prompt log-probs, until it has them (its samples share them)."""
        return self.params.prompt_logprobs is not None and self.sample_index == 0 and self.prompt_logprobs is None

    def append_token(self, token: int, logprob: float | None, top: list[tuple[int, float]] | None = None) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self.output_ids.append(token)
        if self.grammar is not None and not self.grammar.accept(token):  # masked out: cannot happen
            self.finish("error", error=f"token {token} was drawn where the structured output does not allow it")
            return
        if logprob is not None and self.params.logprobs:
            self.logprobs.append(logprob)
            if self.params.top_logprobs:
                self.top_logprobs.append(top or [])
        n, p = len(self.output_ids), self.params
        may_stop = n >= p.min_new_tokens
        matched = self.stop_strings.add(self.output_ids, check=may_stop) if self.stop_strings is not None else None
        if not p.ignore_eos and token in self.eos_ids and may_stop:
            self.finish("stop")
        elif token in p.stop_token_ids and may_stop:
            self.finish("stop", stop_reason=token)
        elif matched is not None:
            self.finish("stop", stop_reason=matched)
        elif self.ends_by_length():
            self.finish("length")

    def finish(self, reason: str, error: str | None = None, stop_reason: int | str | None = None) -> None:
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.finish_time = time.time()

    def _prompt_logprobs_out(self) -> dict:
        source = self.first_sample.prompt_logprobs if self.first_sample is not None else self.prompt_logprobs
        if self.params.prompt_logprobs is None or source is None:
            return {}
        tops = [[]] + [list(t) for t in source.top] if source.top is not None else None
        return {"prompt_logprobs": [None] + list(source.logprobs),  # the first prompt token has none
                "prompt_top_logprobs": tops}

    def visible_text(self) -> str | None:
        """The response text a reader may see now, when the engine detokenizes it (stop strings): a
        possible partial stop string at the end is held back until the next token decides it."""
        if self.stop_strings is None:
            return None
        return self.stop_strings.text[: self.stop_strings.safe_len(self.finished)]

    def start_on_weights(self, version: str) -> None:
        """At admission: every token from the first comes from weights ``version`` until told otherwise."""
        self.weight_versions = [(0, version)]

    def note_new_weights(self, version: str) -> None:
        """A weight update landed mid-request: tokens from the next one on come from ``version``."""
        self.weight_versions.append((len(self.output_ids), version))

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

    def ends_by_length(self, pending: int = 0) -> bool:
        """Whether it is at its length limit (``max_new_tokens`` or the context) once ``pending`` more
        tokens are appended: known before their values are (async scheduling)."""
        return (len(self.output_ids) + pending >= self.params.max_new_tokens
                or self.length + pending >= self.max_len)

    def suppressed_now(self, pending: int = 0) -> tuple[int, ...]:
        """Token ids the next draw may not take (EOS and stop ids before min_new_tokens); ``pending``:
        tokens drawn before it that are not appended yet (async scheduling)."""
        if len(self.output_ids) + pending >= self.params.min_new_tokens:
            return ()
        return tuple(self.eos_ids) + self.params.stop_token_ids if not self.params.ignore_eos else self.params.stop_token_ids

    def allowed_now(self) -> "TokenMask | None":
        """Structured output: the tokens the next draw may take, None without a grammar. Needs
        every drawn token appended, so such a sequence never runs ahead of its answers."""
        return self.grammar.allowed() if self.grammar is not None else None

    @property
    def runs_ahead(self) -> bool:
        """Whether its next step may be built before this one's token is known (async scheduling): not
        with a history kept on the host (penalties) nor a grammar that must follow each token first."""
        return not self.sampling.has_penalties and self.grammar is None

    def to_output(self, decode: Callable[[list[int]], str] | None, token_ids: list[int], finish_reason: str | None,
                  error: str | None, text: str | None = None) -> RequestOutput:
        """The request's output with its first ``len(token_ids)`` tokens (a caller's consistent snapshot);
        ``text``: the engine's own detokenized text, when it keeps one."""
        n = len(token_ids)
        if text is None and decode is not None:
            text = decode(token_ids)
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_ids),
            token_ids=token_ids,
            text=text,
            finish_reason=finish_reason,
            stop_reason=self.stop_reason if finish_reason is not None else None,
            logprobs=list(self.logprobs[:n]) if self.params.logprobs else None,
            prompt=self.prompt,
            error=error,
            sample_index=self.sample_index,
            top_logprobs=[list(t) for t in self.top_logprobs[:n]] if self.params.top_logprobs and self.params.logprobs
            else None,
            **self._prompt_logprobs_out(),
            metrics={
                "arrival_time": self.arrival_time,
                "first_token_time": self.first_token_time,
                "finish_time": self.finish_time,
                "preemptions": self.preemptions,
                "cached_tokens": self.cached_tokens,
            },
        )
