"""Control calls: one dataclass per thing the driver can ask a worker to do.

The driver wraps a call in a ``Call`` envelope (its id) and every addressed rank
answers with a ``Reply``. Each call owns the rest of its contract: ``reply``, how
the ranks' answers become the one answer the driver gets (``WorkerPool.ask``), and
``wait_s``, how long the driver waits for them. The worker picks its handler by the
call's type (``worker/*_handlers.py``); no method name travels as a string.
``StepCommand`` (steps.py) is the hot path and is not a call: only TP rank 0 answers it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from pat_engine.protocol.switch import SwitchPlan, SwitchReport

R = TypeVar("R")


class ReplyRule(enum.Enum):
    """How the addressed ranks' answers (in rank order) become a call's answer."""

    NONE = "none"  # nothing: the call is done once every rank has answered
    EACH = "each"  # every rank's own answer, in rank order
    FIRST = "first"  # rank 0's: every rank did the same (a count of tensors applied)
    SUM = "sum"  # summed over the ranks (bytes freed)
    MIN = "min"  # the least (what every rank can hold)
    ALL = "all"  # True when every rank says so
    MERGE = "merge"  # the answers' own merge (``SwitchReport.merge``)

    def combine(self, values: list) -> Any:
        if self is ReplyRule.NONE:
            return None
        if self is ReplyRule.EACH:
            return values
        if self is ReplyRule.FIRST:
            return values[0]
        if self is ReplyRule.SUM:
            return sum(values)
        if self is ReplyRule.MIN:
            return min(values)
        if self is ReplyRule.ALL:
            return all(values)
        return type(values[0]).merge(values)


class WorkerCall(Generic[R]):
    """Base of every control call (the worker dispatches on the subclass); ``R`` is the driver's answer."""

    reply: ClassVar[ReplyRule] = ReplyRule.NONE

    def wait_s(self) -> float | None:
        """Seconds the driver waits for every addressed rank (None: the engine's ``step_timeout_s``)."""
        return None


# ---- layout and diagnostics ---------------------------------------------------------------------


@dataclass(frozen=True)
class Switch(WorkerCall[SwitchReport]):
    """Run one live layout change; each rank answers its ``SwitchReport``, merged for the cluster."""

    plan: SwitchPlan
    reply = ReplyRule.MERGE


@dataclass(frozen=True)
class Stats(WorkerCall[list[dict]]):
    """Communication-group cache counters, the KV pool size, graphs, device and allocator counters; each rank
    answers a dict. ``release_cached``: the allocator gives its unused cached blocks back to the device
    first (dropped graph pools among them), so ``reserved`` reads what the rank holds: a leak check's reading."""

    release_cached: bool = False
    reply = ReplyRule.EACH


@dataclass(frozen=True)
class BandwidthProbe(WorkerCall[list[float]]):
    """Best seconds to send ``nbytes`` to the next rank while receiving as many from the previous, per rank,
    along ``path`` (parallel/p2p.py; None: the path the world's switches take)."""

    nbytes: int
    repeats: int = 3
    path: str | None = None
    reply = ReplyRule.EACH


@dataclass(frozen=True)
class Shutdown(WorkerCall[None]):
    """Answer, then leave the serve loop."""

    timeout_s: float = 10.0

    def wait_s(self) -> float:
        return self.timeout_s


@dataclass(frozen=True)
class StartProfile(WorkerCall[None]):
    """Start ``torch.profiler`` over this rank's work (CPU, and CUDA kernels on a GPU); after ``num_steps``
    steps (None: at ``StopProfile``) it stops and writes its files into ``output_dir``, named from ``name``
    (worker/profile_handlers.py)."""

    output_dir: str
    name: str
    num_steps: int | None = None
    record_shapes: bool = False
    with_stack: bool = False


@dataclass(frozen=True)
class StopProfile(WorkerCall[list[list[str]]]):
    """Stop the rank's profile (if its steps have not stopped it) and answer the files it wrote."""

    reply = ReplyRule.EACH


# ---- weights ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadWeights(WorkerCall[int]):
    """Full Hugging Face-named tensors; each rank loads its shards under the current layout and answers
    how many it applied (the same names on every rank)."""

    tensors: list[tuple[str, Any]]
    reply = ReplyRule.FIRST


@dataclass(frozen=True)
class LoadWeightsFromHandles(WorkerCall[int]):
    """One bucket of full named tensors passed by handle (``model.weight_handles``): worker ``r``
    rebuilds ``payloads[r % len(payloads)]`` itself and copies its shards; the memory stays the trainer's."""

    payloads: list[bytes]
    reply = ReplyRule.FIRST


@dataclass(frozen=True)
class ReloadWeights(WorkerCall[None]):
    """Reload every shard from the checkpoint at ``path``."""

    path: str


@dataclass(frozen=True)
class InitWeightsUpdateGroup(WorkerCall[None]):
    """Join a trainer's weight-update group as rank ``rank_offset + worker rank``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float

    def wait_s(self) -> float:
        return self.timeout_s + 30  # the join waits for the trainer too: its own timeout plus the round trip


@dataclass(frozen=True)
class UpdateWeightsFromDistributed(WorkerCall[int]):
    """Receive the trainer's broadcast of full tensors (in ``names`` order) and load the shards; answers
    how many were applied."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    timeout_s: float | None = None  # how long the driver waits (None: the step timeout)
    reply = ReplyRule.FIRST

    def wait_s(self) -> float | None:
        return self.timeout_s


@dataclass(frozen=True)
class DestroyWeightsUpdateGroup(WorkerCall[bool]):
    """Leave the group ``group_name``; True when every rank was in it."""

    group_name: str
    reply = ReplyRule.ALL


# ---- memory ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVBudget(WorkerCall[int]):
    """GPU: bytes a rank can give the KV pool from its share of the device's memory (``gpu_memory_utilization``
    or ``rank_memory_fraction``, parallel/devices.py); the least over the ranks, since every rank holds a
    pool of the same size."""

    reply = ReplyRule.MIN


@dataclass(frozen=True)
class AllocateKV(WorkerCall[None]):
    """GPU start-up: the first KV pool, once the driver knows what every rank can hold."""

    num_blocks: int


@dataclass(frozen=True)
class ReleaseMemory(WorkerCall[int]):
    """Free the KV pool (``kv``) and/or the weights (``weights``: "offloaded" or "discarded");
    the answer is the bytes freed, summed over the ranks."""

    kv: bool
    weights: str | None
    reply = ReplyRule.SUM


@dataclass(frozen=True)
class RestoreMemory(WorkerCall[None]):
    """Give back what ``ReleaseMemory`` freed: a KV pool of ``kv_blocks`` (None: leave the KV alone)
    and/or the weights."""

    kv_blocks: int | None
    weights: bool


@dataclass
class Call:
    """The envelope: ``body`` runs on every addressed worker; each one replies with ``call_id``."""

    call_id: int
    body: WorkerCall[Any]


@dataclass
class Reply:
    call_id: int
    rank: int
    ok: bool
    value: Any = None
    error: str | None = None  # formatted traceback when ok is False
    error_type: str | None = None  # the exception's class name, so the driver can re-raise its kind
