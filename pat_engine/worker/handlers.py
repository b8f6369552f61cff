"""How a worker finds the handler of a control call: by the call's type.

A handler is a public method whose parameter ``call`` is annotated with a ``WorkerCall``
subclass (``def release(self, call: ReleaseMemory) -> int``); the annotation is its one
registration. The handlers are grouped by concern: ``layout_handlers`` (switch, group and
bandwidth diagnostics), ``weight_handlers`` (RL weight sync), ``memory_handlers`` (release,
restore, the GPU KV budget), ``profile_handlers`` (torch.profiler sessions); the ``Worker`` answers ``Shutdown``
itself.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, Callable

from pat_engine.protocol.calls import WorkerCall


def handled_calls(owner: type) -> dict[type[WorkerCall], str]:
    """The calls ``owner``'s methods handle: call type -> method name."""
    out: dict[type[WorkerCall], str] = {}
    for name, fn in inspect.getmembers(owner, inspect.isfunction):
        if name.startswith("_") or "call" not in inspect.signature(fn).parameters:
            continue
        call = typing.get_type_hints(fn).get("call")
        if isinstance(call, type) and issubclass(call, WorkerCall) and call is not WorkerCall:
            out[call] = name
    return out


def handler_table(*owners: object) -> dict[type[WorkerCall], Callable[[Any], Any]]:
    """Every call the ``owners`` handle, bound to its handler; a call with two handlers is refused."""
    table: dict[type[WorkerCall], Callable[[Any], Any]] = {}
    for owner in owners:
        for call, name in handled_calls(type(owner)).items():
            if call in table:
                raise TypeError(f"two handlers for the control call {call.__name__}")
            table[call] = getattr(owner, name)
    return table
