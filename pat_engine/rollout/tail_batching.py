"""Tail batching (RollPacker sec. 3): short rounds race, long rounds run the deferred prompts.

A step that needs P0 prompts x R0 responses either

- runs a **short round**: launch ceil(P0*(1+eta)) prompts x ceil(R0*(1+eta)) responses; the
  round ends as soon as P0 prompts each have R0 finished responses; those prompts keep their
  first R0 finished responses, everything else is aborted and the other prompts join the
  long-prompt queue with their partial outputs; or
- runs a **long round** when the queue holds at least P0 prompts: exactly the P0 oldest, R0
  responses each, no over-provisioning, every response runs to its end.

A finite prompt stream (``pat-serve batch``) ends cleanly: a short round takes what is left
(all of it must finish when that is P0 or fewer), and once the stream is empty the queued
prompts run in a final long round, so every prompt is answered. A prompt may carry its own
R0 (``PromptEntry.responses``, a batch line's ``n``); a short round over-provisions it too.

Pure logic: the runner (or the simulator) feeds finish events and gets back what to abort.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Partial:
    """What a response had generated when its round closed (aborted or finished too late to count)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None  # "stop" or "length" when it ran to its end; None when it was aborted
    weights_version: int  # the weights it was generated under; older ones are stale (see docs/rollout.md)
    params: Any = None  # the SamplingParams it ran with (explicit seed): resumption reuses them
    output: Any = None  # the whole RequestOutput when it finished: a long round returns it as it is

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PromptEntry:
    uid: int  # stable across steps: the dataset's prompt id
    prompt: Any  # text, token ids, or chat messages: whatever the engine accepts
    deferrals: int = 0  # how many short rounds aborted it
    responses: int | None = None  # its own R0 (a pat-serve batch line's n); None: the step's
    partials: dict[int, Partial] = field(default_factory=dict)  # response index -> partial output
    metadata: dict[str, Any] = field(default_factory=dict)  # handed to the reward with each response (ground truth, ...)


@dataclass(frozen=True)
class RoundPlan:
    kind: str  # "short" (over-provisioned race), "long" (deferred prompts), "plain" (tail batching off)
    prompts: tuple[PromptEntry, ...]
    responses: int  # launched per prompt
    accept_prompts: int  # P0
    accept_responses: int  # R0
    eta: float = 0.0  # a short round's over-provisioning, applied to a prompt's own R0 too

    def accept_of(self, p: int) -> int:
        """R0 of prompt ``p``: responses it returns."""
        own = self.prompts[p].responses
        return self.accept_responses if own is None else own

    def launch_of(self, p: int) -> int:
        """Responses launched for prompt ``p``."""
        own = self.prompts[p].responses
        if own is None:
            return self.responses
        return overprovision(own, self.eta) if self.kind == "short" else own

    @property
    def launched(self) -> int:
        return sum(self.launch_of(p) for p in range(len(self.prompts)))


def overprovision(n: int, eta: float) -> int:
    return math.ceil(n * (1 + eta) - 1e-9)


class TailBatcher:
    """Chooses short or long rounds and keeps the long-prompt queue."""

    def __init__(self, eta: float):
        self.eta = eta
        self.queue: deque[PromptEntry] = deque()

    def plan(self, p0: int, r0: int, draw: Callable[[int], list[PromptEntry]]) -> RoundPlan:
        """``draw(n)``: the next (up to) n fresh prompts; fewer, or none, once a finite stream runs out.

        An empty plan means the stream and the queue are both empty: nothing is left to run.
        """
        if len(self.queue) >= p0:
            return self._long(p0, r0)
        fresh = tuple(draw(overprovision(p0, self.eta)))
        if not fresh:  # the stream is over: the deferred prompts left run in a final long round
            return self._long(len(self.queue), r0)
        return RoundPlan("short", fresh, overprovision(r0, self.eta), min(p0, len(fresh)), r0, self.eta)

    def _long(self, n: int, r0: int) -> RoundPlan:
        prompts = tuple(self.queue.popleft() for _ in range(n))
        return RoundPlan("long", prompts, r0, n, r0)

    def defer(self, entries: list[PromptEntry]) -> None:
        for e in entries:
            e.deferrals += 1
            self.queue.append(e)


class RoundTracker:
    """Follows one round's finish events; says when it is over and what it returns.

    Events are (prompt index in the plan, response index); the order they arrive in is the
    order responses are accepted in (first R0 finished win; a prompt counts when its R0-th
    response finishes).
    """

    def __init__(self, plan: RoundPlan):
        self.plan = plan
        self.finished: list[list[int]] = [[] for _ in plan.prompts]  # response indices, in finish order
        self.complete: list[int] = []  # prompt indices, in the order they reached R0 finished responses
        self.closed = False

    def on_finished(self, prompt: int, response: int) -> bool:
        """Record one finished response; True when the round is over (ignored once it is)."""
        if self.closed:
            return True
        done = self.finished[prompt]
        if response in done:
            raise ValueError(f"response {response} of prompt {prompt} reported finished twice")
        done.append(response)
        if len(done) == self.plan.accept_of(prompt):
            self.complete.append(prompt)
        self.closed = len(self.complete) >= self.plan.accept_prompts
        return self.closed

    @property
    def done(self) -> bool:
        return self.closed

    def returned_with(self, prompt: int, response: int) -> list[int]:
        """Right after ``on_finished(prompt, response)`` (the round still open): which of the prompt's finished
        responses are now sure to be returned, by this round or, deferred, by a later one, and were not
        sure before; empty for a response nobody will return.

        A prompt that completes now is accepted: its first R0 finished responses all return. A finish past
        its first R0 never returns. Before the prompt completes, a finish with index < R0 returns either
        way (accepted: it is among the first R0; deferred: responses 0..R0-1 are kept); one with index >= R0
        returns only if the prompt completes, so it is answered then."""
        done, r0 = self.finished[prompt], self.plan.accept_of(prompt)
        if len(done) > r0:
            return []
        if len(done) == r0:  # just completed: the first R0 it had not answered for yet
            return [r for r in done if r >= r0 or r == response]
        return [response] if response < r0 else []

    def accepted(self) -> list[tuple[int, list[int]]]:
        """(prompt index, its first R0 finished response indices) for the P0 prompts the round returns."""
        return [(p, self.finished[p][: self.plan.accept_of(p)]) for p in self.complete[: self.plan.accept_prompts]]

    def deferred(self) -> list[int]:
        """Prompt indices that go to the long-prompt queue (short rounds only)."""
        taken = {p for p, _ in self.accepted()}
        return [p for p in range(len(self.plan.prompts)) if p not in taken]

    def unfinished(self) -> list[tuple[int, int]]:
        """(prompt, response) pairs still running: what to abort once the round is over."""
        return [(p, r) for p in range(len(self.plan.prompts)) for r in range(self.plan.launch_of(p))
                if r not in self.finished[p]]
