"""Draft proposers: the tokens a request is guessed to generate next, without a draft model.

``NgramProposer`` matches the request's last n tokens (longest n first, n in
[min_ngram, max_ngram]) in three kinds of text and proposes what followed the match:
the request's own prompt and output, its live siblings (unfinished requests with the same
prompt: the n samples of one prompt, or the same prompt submitted again), and finished
responses to the same prompt (``ResponseStore``: the siblings that already ended, and with
``history`` on, responses from earlier batches or RL steps). Among the matches of the
longest n, the longest continuation wins (the request's own text first on ties).

A wrong guess costs only verify work: the verifier keeps exactly the tokens decoding
would have produced (spec/verify.py).
"""

from __future__ import annotations

from typing import Protocol

from pat_engine.core.request import Sequence
from pat_engine.speculative.config import SpeculativeConfig
from pat_engine.speculative.ngram import NgramIndex
from pat_engine.speculative.store import ResponseStore


class DraftProposer(Protocol):
    """What the engine's speculation asks for drafts (tests plug in their own)."""

    def track(self, seq: Sequence) -> None:
        """``seq`` was queued (called again after a restart re-queues it: idempotent)."""

    def release(self, seq: Sequence) -> None:
        """``seq`` left the engine (finished, aborted or withdrawn)."""

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to ``k`` tokens ``seq`` is guessed to generate next (none: no guess)."""


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, store: ResponseStore | None = None):
        self.config = config
        self.store = store or ResponseStore(config.history_prompts, config.history_responses, config.history_tokens,
                                            config.min_ngram, config.max_ngram)
        self._index: dict[int, NgramIndex] = {}  # seq_id -> index of its tokens (built when first drafted for)
        self._live: dict[int, Sequence] = {}  # seq_id -> unfinished sequence
        self._families: dict[tuple[int, ...], set[int]] = {}  # prompt -> live seq_ids with that prompt

    def track(self, seq: Sequence) -> None:
        self._live[seq.seq_id] = seq
        self._families.setdefault(tuple(seq.prompt_ids), set()).add(seq.seq_id)

    def release(self, seq: Sequence) -> None:
        if self._live.pop(seq.seq_id, None) is None:
            return
        self._index.pop(seq.seq_id, None)
        key = tuple(seq.prompt_ids)
        family = self._families.get(key, set())
        family.discard(seq.seq_id)
        if seq.finished and (self.config.siblings or self.config.history):
            self.store.add(key, seq.output_ids)
        if not family:
            self._families.pop(key, None)
            if not self.config.history:  # the store held this batch's finished siblings only
                self.store.drop(key)

    def remember(self, prompt: list[int], response: list[int]) -> None:
        """An earlier response to ``prompt`` from elsewhere (e.g. the rollout layer's previous step)."""
        self.store.add(prompt, response)

    def _indexed(self, seq: Sequence, tokens: list[int]) -> NgramIndex:
        index = self._index.get(seq.seq_id)
        if index is None:
            index = self._index[seq.seq_id] = NgramIndex(self.config.min_ngram, self.config.max_ngram)
        index.update(tokens)
        return index

    def _sources(self, seq: Sequence, tokens: list[int]) -> list[tuple[list[int], NgramIndex]]:
        sources = [(tokens, self._indexed(seq, tokens))]
        if self.config.siblings:
            for sid in sorted(self._families.get(tuple(seq.prompt_ids), ())):
                sib = self._live.get(sid)
                if sib is not None and sid != seq.seq_id and sib.output_ids:
                    sib_tokens = sib.tokens
                    sources.append((sib_tokens, self._indexed(sib, sib_tokens)))
        if self.config.siblings or self.config.history:
            sources += [(r.tokens, r.index) for r in self.store.responses(seq.prompt_ids)]
        return sources

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = seq.tokens
        sources = self._sources(seq, tokens)
        for n in range(min(self.config.max_ngram, len(tokens)), self.config.min_ngram - 1, -1):
            gram = tuple(tokens[-n:])
            best: list[int] = []
            for text, index in sources:
                end = index.end_of(gram)
                if end is not None and len(text) - end > len(best):
                    best = text[end : end + k]
                    if len(best) == k:
                        return best
            if best:
                return best
        return []
