"""Per-worker cache of communication groups, one entry per layout.

Creating process groups is collective and slow (NCCL communicators especially),
so a layout's TP groups are built the first time it is asked for and reused on
every later switch (the paper's Fig. 9). Every rank must ask for the same
layouts in the same order, because ``new_group`` is collective over the world.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.layout import Layout
from pat_engine.parallel import ipc_collectives, p2p, shm_collectives


@dataclass
class GroupPoolStats:
    hits: int = 0
    misses: int = 0
    creation_seconds: float = 0.0
    created_layouts: list[str] = field(default_factory=list)


class CommGroupPool:
    def __init__(self, global_rank: int, world: int, device_backend: str, timeout=None, host_staged: bool = False,
                 device: torch.device | None = None):
        self.global_rank = global_rank
        self.world = world
        self.device_backend = device_backend
        self.host_staged = host_staged  # ranks share a GPU: no NCCL between them (parallel/devices.py)
        self.device = device or torch.device("cpu")  # where this rank's model runs (its IPC slots live there)
        self.timeout = timeout
        self.stats = GroupPoolStats()
        self._groups: dict[Layout, TPGroup] = {}

    @property
    def p2p_path(self) -> str:
        """How this world's switch traffic travels (parallel/p2p.py: direct, host or handles)."""
        return p2p.path_for(self.host_staged)

    def get(self, layout: Layout) -> tuple[TPGroup, bool]:
        """Return this rank's TP group for ``layout`` and whether it was a cache hit."""
        if layout in self._groups:
            self.stats.hits += 1
            return self._groups[layout], True
        start = time.perf_counter()
        mine = None
        for ranks in layout.all_groups():
            handle = self._create(ranks)
            if self.global_rank in ranks:
                mine = handle
        self.stats.misses += 1
        self.stats.creation_seconds += time.perf_counter() - start
        self.stats.created_layouts.append(str(layout))
        assert mine is not None
        self._groups[layout] = mine
        return mine, False

    def _create(self, ranks: list[int]) -> TPGroup:
        my_index = ranks.index(self.global_rank) if self.global_rank in ranks else -1
        if len(ranks) == 1:
            # A one-rank group needs no communicator; keep creation collective-free.
            return TPGroup(rank=max(my_index, 0), size=1, ranks=tuple(ranks))
        device = dist.new_group(ranks, backend=self.device_backend, timeout=self.timeout)
        shm = ipc = None
        if my_index >= 0 and shm_collectives.usable(self.device_backend):
            shm = shm_collectives.ShmChannel.create(device, my_index, len(ranks), self.timeout)
        if my_index >= 0 and ipc_collectives.wanted(self.host_staged, self.device_backend):
            ipc = ipc_collectives.IpcChannel.create(device, my_index, len(ranks), self.timeout, self.device)
        return TPGroup(rank=my_index, size=len(ranks), ranks=tuple(ranks), device_group=device, shm=shm, ipc=ipc,
                       host_staged=self.host_staged)

    def close(self) -> None:
        """Let go of what the groups map of other processes (the IPC channels' peer slots), at shutdown."""
        for group in self._groups.values():
            if group.ipc is not None:
                group.ipc.close()

    def __len__(self) -> int:
        return len(self._groups)
