"""Multi-turn agent rollouts: every later turn reuses the KV of the turns before it.

An agent loop (veRL's ``ToolAgentLoop``, OpenRLHF's ``MultiTurnAgentExecutor``) sends each turn as a
new request whose prompt is the whole conversation so far: the previous turn's prompt, its response,
then the tool's (or environment's) answer. The engine's prefix cache keeps the full KV blocks of the
previous turn, prompt and response alike (a generated block is registered as it fills), so a turn
prefills only what is new, provided two things the plain engine does not ensure:

- the turn lands on the DP group that holds those blocks (``PrefixAffinity``): the engine's own rule
  places a request on the group with the fewest outstanding tokens, which need not be the group where
  the previous turn ran;
- no layout switch comes between the turns: the adapters start a new stage, back at the base layout,
  when a request finds the engine idle, and a switch keeps only the blocks running requests hold
  (cached blocks no request uses are not moved). While its tool runs a trajectory has no request in
  the engine, so an agent rollout often leaves the engine idle between turns. A request that continues
  an answer of this stage under the same weights (``TurnLedger``) therefore joins the stage instead
  (``frontend.AsyncEngineFrontend``).

A mid-stage switch (the schedule's or the controller's) still drops the cached blocks of trajectories
that are between turns at that moment: their next turn prefills in full.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from typing import Any, Sequence

from pat_engine.core.stepping import fewest_outstanding

HEAD = 64  # prompt tokens that index a record (the conversation's start: its system prompt and question)


class PrefixAffinity:
    """Admission placement (``Engine.set_placement``): a later turn of a conversation of this stage (the
    ``ledger`` says so) goes to the DP group holding the longest cached prefix of it, as veRL's sticky
    sessions keep a conversation on one server; any other request, or a turn whose earlier turns are
    cached nowhere, is placed by the engine's own rule (fewest outstanding tokens). Conversations are
    balanced over the groups at their first turn; the cache alone does not attract requests (a system
    prompt every request shares would send them all to one group)."""

    def __init__(self, ledger: "TurnLedger"):
        self.ledger = ledger

    def __call__(self, seq: Any, schedulers: Sequence[Any]) -> int:
        if self.ledger.continues(seq.prompt_ids, self.ledger.version):
            cached = [sched.cached_tokens(seq) for sched in schedulers]
            if max(cached) > 0:
                return max(range(len(schedulers)), key=lambda g: (cached[g], -g))
        return fewest_outstanding(seq, schedulers)


class TurnLedger:
    """Answers of the current stage, remembered as (prompt + first response token) under one weight version.

    ``continues(prompt)``: the prompt starts with such a sequence (a later turn of that conversation, or
    an aborted answer resubmitted with its tokens so far). Only the first response token is required:
    an agent loop may re-render the end of a response (a stop string, a trailing special token).
    Records are (length, digest) pairs; those of ``HEAD`` tokens or more are indexed by their first
    ``HEAD`` tokens, so a lookup checks only the records of its own conversation. A lookup digests the
    prompt once, incrementally, at each candidate length, outside the lock (a long conversation has
    many records, each a prefix of the next turn's prompt). The oldest records go first beyond
    ``capacity``.
    """

    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity
        self.version: str | None = None
        self._records: OrderedDict[tuple[int, bytes], bytes | None] = OrderedDict()  # (length, digest) -> head
        self._by_head: dict[bytes, set[tuple[int, bytes]]] = {}
        self._lock = threading.Lock()  # recorded by the frontend, read by the engine's placement too

    def reset(self) -> None:
        """Forget every conversation (the prefix cache was dropped)."""
        with self._lock:
            self._reset(None)

    def _reset(self, version: str | None) -> None:
        self.version = version
        self._records.clear()
        self._by_head.clear()

    def record(self, prompt: Sequence[int], response: Sequence[int], version: str) -> None:
        if not response:
            return
        seq = [*prompt, response[0]]
        lengths = [HEAD, len(seq)] if len(seq) >= HEAD else [len(seq)]
        digests = _prefix_digests(seq, lengths)
        rec = (len(seq), digests[len(seq)])
        head = digests.get(HEAD)  # None below HEAD tokens
        with self._lock:
            if version != self.version:
                self._reset(version)
            self._records[rec] = head
            self._records.move_to_end(rec)
            if head is not None:
                self._by_head.setdefault(head, set()).add(rec)
            while len(self._records) > self.capacity:
                old, old_head = self._records.popitem(last=False)
                if old_head is not None:
                    self._by_head[old_head].discard(old)

    def continues(self, prompt: Sequence[int], version: str) -> bool:
        tokens = list(prompt)
        with self._lock:
            if version != self.version or not self._records:
                return False
        head = _prefix_digests(tokens, [HEAD])[HEAD] if len(tokens) >= HEAD else None
        with self._lock:
            recorded = [n for n, _ in self._by_head.get(head, ())] if head is not None else []
        lengths = sorted({*range(1, min(HEAD, len(tokens) + 1)), *(n for n in recorded if n <= len(tokens))})
        keys = _prefix_digests(tokens, lengths).items()
        with self._lock:  # a record made or dropped meanwhile: the answer of a moment earlier or later
            return version == self.version and any(key in self._records for key in keys)


def _prefix_digests(tokens: Sequence[int], lengths: Sequence[int]) -> dict[int, bytes]:
    """The digest of ``tokens[:n]`` for each n in ``lengths`` (each <= len(tokens)), in one pass."""
    data = array("q", tokens).tobytes()
    h, done, out = hashlib.blake2b(digest_size=16), 0, {}
    for n in sorted(set(lengths)):
        h.update(data[done * 8: n * 8])
        done = n
        out[n] = h.copy().digest()
    return out
