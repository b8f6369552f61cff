"""Tensor-parallel collectives through shared memory, for CPU workers on one host.

gloo sends every all-reduce through the loopback TCP stack: about 1.4 ms for a 512-float
tensor between two processes on this project's machine, and a TP2 decode step makes ten
of them (two per layer, the embedding, the logits gather). Here each rank copies its tensor
into its own slot of a shared segment, publishes a sequence number, and waits for every
peer's; then all ranks sum the slots in rank order (so every rank gets the same bits).
vLLM's CPU build does the same for the same reason.

Why it is safe without locks:
- Slots alternate between two sets by the sequence number's parity. A rank writes
  collective k+2 only after finishing k+1, which needs every peer to have published k+1,
  which each peer does only after it finished reading collective k: the set being
  overwritten is no longer read.
- Every operation waits for all peers (gather too), so that argument holds for every call.
- x86-64 keeps stores in program order (TSO) and loads in order with other loads: a peer
  that sees the number also sees the data written before it. Elsewhere the channel is not
  used (gloo serves), since other CPUs would need explicit fences.

A peer that dies is noticed within ``_LIVENESS_EVERY_S`` (its pid is gone) and one that
hangs within the collective timeout: both raise ``CollectiveError``, never hang. Tensors
larger than a slot (long prefills, big-vocab logits) go through gloo.
"""

from __future__ import annotations

import os
import platform
import socket
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from pat_engine import env

SLOT_BYTES = 4 << 20  # per rank and parity; tmpfs only backs the pages a collective touches
_HEADER_BYTES = 64 * 8  # one int64 sequence number per rank (up to 64 ranks)
_LIVENESS_EVERY_S = 0.1
_SPINS_BEFORE_YIELD = 64  # busy-poll this often, then give the core away once


class CollectiveError(RuntimeError):
    """A TP peer died or missed the collective timeout."""


def board_usable(backend: str) -> bool:
    """Whether a group's members can meet on a shared sequence board: gloo groups (the board's set-up
    gathers over the group) on x86-64 (its store order: module docstring)."""
    return backend == "gloo" and platform.machine().lower() in ("x86_64", "amd64")


def usable(backend: str) -> bool:
    """Shared memory serves the CPU (gloo) groups on x86-64; ``PAT_CPU_COLLECTIVES=gloo`` turns it off."""
    return board_usable(backend) and env.shm_collectives()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped by its parent) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in (b"Z", b"X")


def seconds_of(timeout: timedelta | None) -> float:
    """A group's collective timeout in seconds (torch's default when the group has none)."""
    return timeout.total_seconds() if timeout else 120.0


def join(device_group: object, rank: int, size: int, extra: object = None) -> tuple[str, list[int], list] | None:
    """Collective over the group: the shared segment's name, each member's pid and ``extra`` (in group rank
    order), if every member runs on this host; else None. Every member maps the segment, then calls
    ``forget_name``."""
    token = f"/dev/shm/pat-tp-{uuid.uuid4().hex}" if rank == 0 else None
    members: list[tuple[str, int, str | None, object] | None] = [None] * size
    dist.all_gather_object(members, (socket.gethostname(), os.getpid(), token, extra), group=device_group)
    if len({host for host, _, _, _ in members}) != 1:
        return None
    return members[0][2], [pid for _, pid, _, _ in members], [e for _, _, _, e in members]


def forget_name(device_group: object, rank: int, path: str) -> None:
    """Once every member has mapped the segment, its name can go (the mappings keep it)."""
    dist.barrier(group=device_group)
    if rank == 0:
        os.unlink(path)


class ShmChannel:
    """One TP group's shared segment; every member holds one, made by ``ShmChannel.create``."""

    HOST_SLOTS = True  # the slots live in the shared segment (ipc_collectives.IpcChannel: in device memory)

    def __init__(self, path: str, rank: int, size: int, pids: list[int], timeout_s: float):
        self.rank, self.size, self.pids, self.timeout_s = rank, size, pids, timeout_s
        total = _HEADER_BYTES + (2 * size * SLOT_BYTES if self.HOST_SLOTS else 0)
        self._raw = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        self._seqs = self._raw[: size * 8].view(torch.int64).numpy()  # numpy: a cheap scalar store/load
        self._seq = 0

    @classmethod
    def create(cls, device_group: object, rank: int, size: int, timeout: timedelta | None) -> "ShmChannel | None":
        """Collective over the group: a channel if every member is on this host, else None."""
        members = join(device_group, rank, size)
        if members is None:
            return None
        path, pids, _ = members
        channel = cls(path, rank, size, pids, seconds_of(timeout))
        forget_name(device_group, rank, path)
        return channel

    def _slot(self, parity: int, rank: int, nbytes: int) -> torch.Tensor:
        start = _HEADER_BYTES + (parity * self.size + rank) * SLOT_BYTES
        return self._raw[start : start + nbytes]

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= SLOT_BYTES

    def _settle(self) -> None:
        """What must finish before peers may read this rank's slot: nothing here (a CPU copy is done when
        it returns); the device's queued copy for slots in device memory."""

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``x``, wait for every peer's, return all ranks' tensors (views of the slots)."""
        self._seq += 1
        parity, nbytes = self._seq % 2, x.numel() * x.element_size()
        mine = self._slot(parity, self.rank, nbytes).view(x.dtype).view(x.shape)
        mine.copy_(x)
        self._settle()
        self._seqs[self.rank] = self._seq
        self._wait_for(self._seq)
        return [self._slot(parity, r, nbytes).view(x.dtype).view(x.shape) for r in range(self.size)]

    def _wait_for(self, seq: int) -> None:
        seqs = self._seqs[: self.size]
        if seqs.min() >= seq:
            return
        start = last_check = time.monotonic()
        while True:
            for _ in range(_SPINS_BEFORE_YIELD):
                if seqs.min() >= seq:
                    return
            os.sched_yield()
            now = time.monotonic()
            if now - last_check >= _LIVENESS_EVERY_S:
                last_check = now
                self._check_peers(seq, now - start)

    def _check_peers(self, seq: int, waited: float) -> None:
        late = [r for r in range(self.size) if self._seqs[r] < seq]
        for r in late:
            if not _alive(self.pids[r]):
                raise CollectiveError(f"TP peer rank {r} (pid {self.pids[r]}) died during a collective")
        if waited > self.timeout_s:
            raise CollectiveError(f"TP peer rank(s) {late} missed a collective for {waited:.0f} s "
                                  f"(collective timeout {self.timeout_s:.0f} s)")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; the same rank order (so the same bits) on every rank."""
        parts = self._exchange(x.contiguous())
        torch.add(parts[0], parts[1], out=x)
        for part in parts[2:]:
            x.add_(part)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` stacked in rank order, ``(size, *x.shape)``, on every rank."""
        return torch.stack(self._exchange(x.contiguous()))

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        """Rank 0 gets every rank's ``x`` concatenated along ``dim``; the others get None."""
        parts = self._exchange(x.contiguous())
        return torch.cat(parts, dim=dim) if self.rank == 0 else None
