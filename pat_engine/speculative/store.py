"""``ResponseStore``: finished responses by prompt, bounded, least recently used prompt out first.

Responses to the same prompt repeat each other (n samples of one GRPO group; the same prompt
in the next RL step), so they are draft sources for the requests still running. The store
holds the latest ``max_responses`` per prompt, at most ``max_prompts`` prompts and
``max_tokens`` tokens (prompts and responses); each response's n-gram index is built on first
use.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pat_engine.speculative.ngram import NgramIndex


@dataclass
class StoredResponse:
    tokens: list[int]  # prompt + response: an n-gram may span the boundary
    index: NgramIndex | None = None


@dataclass
class _PromptEntry:
    responses: deque[StoredResponse] = field(default_factory=deque)
    tokens: int = 0  # counted against the store's cap: the prompt once plus each response


class ResponseStore:
    def __init__(self, max_prompts: int, max_responses: int, max_tokens: int, min_n: int, max_n: int):
        self.max_prompts, self.max_responses, self.max_tokens = max_prompts, max_responses, max_tokens
        self.min_n, self.max_n = min_n, max_n
        self._entries: OrderedDict[tuple[int, ...], _PromptEntry] = OrderedDict()  # least recently used first
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, prompt: Sequence[int], response: Sequence[int]) -> None:
        """Remember ``response`` to ``prompt`` (too short to hold an n-gram: ignored)."""
        if len(response) < self.min_n:
            return
        key = tuple(prompt)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _PromptEntry(tokens=len(key))
            self.tokens += len(key)
        self._entries.move_to_end(key)
        entry.responses.append(StoredResponse(list(key) + list(response)))
        self._count(entry, len(response))
        while len(entry.responses) > self.max_responses:
            self._count(entry, -(len(entry.responses.popleft().tokens) - len(key)))
        while self._entries and (self.tokens > self.max_tokens or len(self._entries) > self.max_prompts):
            self._drop(next(iter(self._entries)))

    def responses(self, prompt: Sequence[int]) -> list[StoredResponse]:
        """The stored responses to ``prompt`` (indexed), latest first; marks the prompt recently used."""
        key = tuple(prompt)
        entry = self._entries.get(key)
        if entry is None:
            return []
        self._entries.move_to_end(key)
        for r in entry.responses:
            if r.index is None:
                r.index = NgramIndex(self.min_n, self.max_n)
                r.index.update(r.tokens)
        return list(reversed(entry.responses))

    def drop(self, prompt: Sequence[int]) -> None:
        self._drop(tuple(prompt))

    def _drop(self, key: tuple[int, ...]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.tokens -= entry.tokens

    def _count(self, entry: _PromptEntry, tokens: int) -> None:
        entry.tokens += tokens
        self.tokens += tokens
