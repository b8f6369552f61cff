"""Waiting in tests on the state a test needs, never on wall time.

A test that sleeps and hopes the engine is still mid-request races the engine's speed: on a fast
host the request is done before the sleep ends. These helpers poll for a condition (a request
running with k tokens produced, a count reached) and fail with a timeout only when it never holds.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable


def wait_for(cond: Callable[[], bool], timeout: float = 60.0, poll: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting for the condition"
        time.sleep(poll)


async def wait_for_async(cond: Callable[[], Any | Awaitable[Any]], timeout: float = 60.0, poll: float = 0.02) -> None:
    """As ``wait_for`` on an event loop; ``cond`` may return an awaitable (a Ray call, say)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if asyncio.iscoroutine(value) or asyncio.isfuture(value) or hasattr(value, "__await__"):
            value = await value
        if value:
            return
        assert time.monotonic() < deadline, "timed out waiting for the condition"
        await asyncio.sleep(poll)


def generated_counts(engine) -> list[int]:
    """Tokens produced so far by each unfinished request (read through the engine's status)."""
    return [r.generated for r in engine.cluster_status().requests]


def wait_tokens(engine, count: int, at_least: int, timeout: float = 60.0) -> None:
    """Until ``count`` requests run and every running one has ``at_least`` tokens."""
    def reached() -> bool:
        counts = generated_counts(engine)
        return len(counts) >= count and all(n >= at_least for n in counts)

    wait_for(reached, timeout)
