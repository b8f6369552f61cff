"""Control calls: one dataclass per thing the driver can ask a worker to do.

The driver wraps a call in a ``Call`` envelope (its id) and every addressed rank
answers with a ``Reply``. The worker picks its handler by the call's type
(``Worker.handle``), so a reader or a tool can follow a call from the
driver's ``WorkerClient`` method to the worker's handler; no method name
travels as a string. ``StepCommand`` (steps.py) is the hot path and is not a
call: only TP rank 0 answers it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pat_engine.protocol.switch import SwitchPlan


class WorkerCall:
    """Base of every control call (a marker: the worker dispatches on the subclass)."""


# ---- layout and diagnostics ---------------------------------------------------------------------


@dataclass(frozen=True)
class Switch(WorkerCall):
    """Run one live layout change; each rank answers its ``SwitchReport``."""

    plan: SwitchPlan


@dataclass(frozen=True)
class Stats(WorkerCall):
    """Communication-group cache counters and the KV pool size; each rank answers a dict."""


@dataclass(frozen=True)
class BandwidthProbe(WorkerCall):
    """Best seconds to send ``nbytes`` to the next rank while receiving as many from the previous."""

    nbytes: int
    repeats: int = 3


@dataclass(frozen=True)
class InjectFault(WorkerCall):
    """Test hook: the next pass through ``where`` raises, hangs or exits (``how``)."""

    where: str
    how: str = "raise"


@dataclass(frozen=True)
class Shutdown(WorkerCall):
    """Answer, then leave the serve loop."""


# ---- weights ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadWeights(WorkerCall):
    """Full Hugging Face-named tensors; each rank loads its shards under the current layout."""

    tensors: list[tuple[str, Any]]


@dataclass(frozen=True)
class LoadWeightsFromHandles(WorkerCall):
    """One bucket of full named tensors passed by handle (``parallel.weight_handles``): worker ``r``
    rebuilds ``payloads[r % len(payloads)]`` itself and copies its shards; the memory stays the trainer's."""

    payloads: list[bytes]


@dataclass(frozen=True)
class ReloadWeights(WorkerCall):
    """Reload every shard from the checkpoint at ``path``."""

    path: str


@dataclass(frozen=True)
class InitWeightsUpdateGroup(WorkerCall):
    """Join a trainer's weight-update group as rank ``rank_offset + worker rank``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float


@dataclass(frozen=True)
class UpdateWeightsFromDistributed(WorkerCall):
    """Receive the trainer's broadcast of full tensors (in ``names`` order) and load the shards."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str


@dataclass(frozen=True)
class DestroyWeightsUpdateGroup(WorkerCall):
    group_name: str


# ---- memory ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVBudget(WorkerCall):
    """GPU: bytes this rank can give the KV pool at ``utilization`` of device memory."""

    utilization: float


@dataclass(frozen=True)
class AllocateKV(WorkerCall):
    """GPU start-up: the first KV pool, once the driver knows what every rank can hold."""

    num_blocks: int


@dataclass(frozen=True)
class ReleaseMemory(WorkerCall):
    """Free the KV pool (``kv``) and/or the weights (``weights``: "offloaded" or "discarded");
    each rank answers the bytes it freed."""

    kv: bool
    weights: str | None


@dataclass(frozen=True)
class RestoreMemory(WorkerCall):
    """Give back what ``ReleaseMemory`` freed: a KV pool of ``kv_blocks`` (None: leave the KV alone)
    and/or the weights."""

    kv_blocks: int | None
    weights: bool


@dataclass
class Call:
    """The envelope: ``body`` runs on every addressed worker; each one replies with ``call_id``."""

    call_id: int
    body: WorkerCall


@dataclass
class Reply:
    call_id: int
    rank: int
    ok: bool
    value: Any = None
    error: str | None = None  # formatted traceback when ok is False
    error_type: str | None = None  # the exception's class name, so the driver can re-raise its kind
