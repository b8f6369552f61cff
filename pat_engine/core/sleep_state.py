"""``SleepState``: what ``sleep`` released and ``wake_up`` has not restored yet.

The one record of the workers' memory for a colocated trainer. It exists so that
a wake-up restores exactly what a sleep gave back and nothing else: waking an
awake engine (RL frameworks do, by tag, and clients retry) must never replace a
KV pool that running requests and the prefix cache still point into.

Tags follow SGLang's ``release/resume_memory_occupation``: ``kv_cache``,
``weights`` and ``cuda_graph`` (the decode graphs read the KV pool and the weights, so a worker
drops them with either and captures them again as steps need them after the wake-up; the tag
only travels with the KV).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from pat_engine.errors import InvalidRequestError

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
OFFLOADED, DISCARDED = "offloaded", "discarded"  # where released weights went: host memory, or nowhere


def check_tags(tags: Iterable[str] | None) -> set[str]:
    """The tags asked for (all of them for None); ``InvalidRequestError`` names an unknown one."""
    wanted = set(MEMORY_TAGS) if tags is None else set(tags)
    unknown = wanted - set(MEMORY_TAGS)
    if unknown:
        raise InvalidRequestError(f"unknown memory tags {sorted(unknown)}; use any of {list(MEMORY_TAGS)}")
    return wanted


def tags_for_level(level: int, on_gpu: bool) -> tuple[set[str], str | None]:
    """vLLM's sleep levels as tags and what becomes of the weights: level 1 frees the KV (on GPU the
    weights go to host memory), level 2 discards the weights too."""
    if level not in (1, 2):
        raise InvalidRequestError(f"sleep level must be 1 or 2, got {level!r}")
    if level == 2:
        return {"kv_cache", "cuda_graph", "weights"}, DISCARDED
    return ({"kv_cache", "cuda_graph", "weights"}, OFFLOADED) if on_gpu else ({"kv_cache", "cuda_graph"}, None)


@dataclass
class SleepState:
    kv_cache: bool = False  # the KV pools are released (the prefix cache was dropped with them)
    weights: str | None = None  # None: resident; OFFLOADED: a host copy comes back; DISCARDED: reloaded or pushed

    @property
    def asleep(self) -> bool:
        """Whether any memory is released: nothing may run until it is back."""
        return self.kv_cache or self.weights is not None

    def released(self) -> set[str]:
        out = {"kv_cache", "cuda_graph"} if self.kv_cache else set()
        return out | ({"weights"} if self.weights is not None else set())

    def clear(self) -> None:
        """Fresh workers hold all their memory."""
        self.kv_cache, self.weights = False, None

    def describe(self) -> str:
        parts = (["the KV cache"] if self.kv_cache else []) + ([f"the weights ({self.weights})"] if self.weights else [])
        return " and ".join(parts) or "nothing"
