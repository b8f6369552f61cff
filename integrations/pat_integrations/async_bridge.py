"""Await a pat-engine request from asyncio code (Ray async actors).

``RequestHandle.wait`` blocks a thread; an actor serving hundreds of requests
at once cannot spend a thread on each, so a listener on the handle resolves an
asyncio future from the engine loop thread instead.
"""

from __future__ import annotations

import asyncio

from pat_engine import RequestHandle, RequestOutput
from pat_engine.outputs import of_prompt


async def await_output(handle: RequestHandle) -> RequestOutput:
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def on_update(h: RequestHandle) -> None:
        if h.done():
            loop.call_soon_threadsafe(_resolve, done)

    handle.add_listener(on_update)
    if handle.done():  # it may have finished before the listener was in place
        _resolve(done)
    await done
    return handle.output()


async def await_samples(handles: list[RequestHandle]) -> RequestOutput:
    """The ``n`` samples of one prompt (sample 0 first) as ``Engine.generate`` returns them."""
    return of_prompt(list(await asyncio.gather(*[await_output(h) for h in handles])))


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
