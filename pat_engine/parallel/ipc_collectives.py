"""Tensor-parallel collectives of ranks sharing one GPU, through each other's device memory (CUDA IPC).

Ranks sharing a GPU have no NCCL (parallel/devices.py). Staged through the host, every collective copies
its tensor to the host and back and waits for the device twice: 0.6 ms an all-reduce on the fourth H100
run, about 20 ms of a 44 ms co-located TP2 decode step of a 1B shape (bench/results/gpu_check.md, part
switch). Here each rank keeps its two slot sets in its own device memory and every peer maps them once,
by CUDA IPC handle (pat_engine/tensor_handles.py). A collective copies the rank's tensor into its slot,
waits for its own device, publishes a sequence number on the host (the shared-memory channel's board,
parallel/shm_collectives.py) and, once every peer has published, reads the peers' slots in a kernel of
its own: the sum in rank order, as the shared-memory channel adds (the same bits on every rank).

Why no stream ever waits on another process: a slot is read only after its owner's device finished
writing it (the owner synchronised before it published), and a slot set is written again two collectives
later, after every peer published the collective in between, which each does only once its device
finished everything queued before, its reads of that set included. A peer that dies is noticed by the
host wait's liveness check (``CollectiveError``); no stream is left waiting on an event that will never
come. The price is one wait for the rank's own device per collective, where the host path has two
and two copies more. Tensors larger than a slot (long prefills, big-vocab logits) take the host path.

A member that cannot export its slots or map a peer's (a driver or allocator refusing CUDA IPC) sends the
whole group to the host path, with a warning that names the failure. On CPU workers the same protocol runs
with slots in shared-memory files (``PAT_COLOCATED_COLLECTIVES=ipc``, tests): there it checks the protocol,
not CUDA's IPC.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from pat_engine import env
from pat_engine.parallel.shm_collectives import ShmChannel, board_usable, forget_name, join, seconds_of
from pat_engine.tensor_handles import device_key, rebuild, serialize

log = logging.getLogger(__name__)
T = TypeVar("T")

SLOT_BYTES = 8 << 20  # per rank and parity, in device memory: a batch of 256 rows of hidden 8192 in float32
HOST, IPC = "host", "ipc"  # PAT_COLOCATED_COLLECTIVES values besides "auto"
HOST_STAGED = "host-staged"  # a path's name (TPGroup.collectives): "ipc" or this, where ranks share a GPU


def wanted(host_staged: bool, backend: str) -> bool:
    """Whether a TP group takes this channel: ranks sharing a GPU (``host_staged``) unless
    ``PAT_COLOCATED_COLLECTIVES=host``, CPU workers only when it says ``ipc`` (tests). The host board needs
    what the shared-memory channel needs (gloo groups, x86-64's store order)."""
    asked = env.colocated_collectives()
    if not board_usable(backend) or asked == HOST:
        return False
    return host_staged or asked == IPC


def colocated_path() -> str:
    """The path a TP group of ranks sharing a GPU is set to take, ``IPC`` or ``HOST_STAGED`` (a group whose
    ranks cannot map each other's slots falls back, with a warning: ``TPGroup.collectives`` says which)."""
    return IPC if wanted(host_staged=True, backend="gloo") else HOST_STAGED


def reserve_bytes(world: int) -> int:
    """Device memory one rank's channels take: two slot sets in each TP group of more than one rank it can
    join (one per power of two up to ``world``), so that a rank's KV budget leaves room for them."""
    groups = max(0, world.bit_length() - 1)
    return groups * 2 * SLOT_BYTES


def _attempt(fn: Callable[[], T]) -> tuple[T | None, str | None]:
    """(fn(), None), or (None, what went wrong) where CUDA IPC is refused (a driver or allocator that cannot
    export or open a handle)."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - reported by _agreed, the group falls back to the host path
        return None, f"{type(exc).__name__}: {exc}"


def _agreed(size: int, errors: list[str | None], what: str) -> bool:
    """Whether no member failed ``what``; if one did, a warning naming it (every member sees the same list)."""
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        r, e = failed[0]
        log.warning("co-located collectives: rank %d of a TP%d group could not %s (%s); its collectives are "
                    "staged through the host instead", r, size, what, e)
    return not failed


class IpcChannel(ShmChannel):
    """One TP group's slots in device memory, every member's mapped by every other; made by ``create``."""

    HOST_SLOTS = False

    def __init__(self, path: str, rank: int, size: int, pids: list[int], timeout: float,
                 slots: list[torch.Tensor]):
        super().__init__(path, rank, size, pids, timeout)
        self.slots = slots  # rank -> (2 * SLOT_BYTES,) bytes: this rank's own, the peers' views of theirs
        self.device = slots[rank].device

    @classmethod
    def create(cls, device_group: object, rank: int, size: int, timeout: timedelta | None,
               device: torch.device) -> "IpcChannel | None":
        """Collective over the group: a channel if every member runs on this host and on one device and
        every member could export its slots and map its peers', else None: the group stages through the
        host, with a warning that says why (every member decides the same from the same gathered facts)."""
        own = torch.zeros(2 * SLOT_BYTES, dtype=torch.uint8, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # zeroed before any peer maps it
        handle, error = _attempt(lambda: serialize(own))
        members = join(device_group, rank, size, (device_key(device), handle, error))
        if members is None:
            return None
        path, pids, extras = members
        if len({key for key, _, _ in extras}) != 1:
            return None
        if not _agreed(size, [e for _, _, e in extras], "export its slots"):
            return None
        # a CPU slot's file reference is dropped by its first reader only (tensor_handles._HandleUnpickler)
        slots, error = _attempt(lambda: [
            own if r == rank else rebuild(h, first_reader=rank == min(set(range(size)) - {r}),
                                          own_device=device if device.type == "cuda" else None)
            for r, (_, h, _) in enumerate(extras)])
        errors: list[str | None] = [None] * size
        dist.all_gather_object(errors, error, group=device_group)
        if not _agreed(size, errors, "map its peers' slots"):
            return None
        channel = cls(path, rank, size, pids, seconds_of(timeout), slots)
        forget_name(device_group, rank, path)
        return channel

    def close(self) -> None:
        """Let go of the peers' slots (at shutdown: their owners may free them once every reader has). A
        closed channel fits nothing: a collective after it takes the host path."""
        self.slots = [self.slots[self.rank]]

    def _slot(self, parity: int, rank: int, nbytes: int) -> torch.Tensor:
        start = parity * SLOT_BYTES
        return self.slots[rank][start : start + nbytes]

    def fits(self, x: torch.Tensor) -> bool:
        return (len(self.slots) == self.size and x.device == self.device
                and x.numel() * x.element_size() <= SLOT_BYTES)

    def _settle(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
