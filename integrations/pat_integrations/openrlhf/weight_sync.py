"""OpenRLHF's weight-update group on CPU: gloo over a TCPStore, one rank per engine device.

OpenRLHF's trainer (DeepSpeed rank 0) is rank 0 of a group of
``num_engines * tensor_parallel_size + 1`` ranks; engine ``i`` holds ranks
``i * tp + 1 .. i * tp + tp``. For each parameter it calls the engines'
``update_weight(name, dtype, shape)`` and then broadcasts the full tensor from
rank 0. A pat engine serves all its devices from one actor, so the actor holds
all ``tp`` of its ranks, each in its own thread (a broadcast is collective:
every rank must take part).

The group is "stateless" (as OpenRLHF's, built on vLLM's
``StatelessProcessGroup``): it needs no default process group and lives next
to whatever group the trainer already has. ``stateless_gloo_group`` is what
the trainer side calls on CPU in place of OpenRLHF's NCCL
``stateless_init_process_group``; its ``broadcast(tensor, src=0, stream=None)``
has the same signature OpenRLHF calls.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0


class StatelessGlooGroup:
    """One rank of a gloo group whose rendezvous is a TCPStore hosted by rank 0."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "openrlhf", timeout_s: float = DEFAULT_TIMEOUT_S):
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                              timeout=timeout, wait_for_workers=False)
        self.rank, self.world_size = rank, world_size
        self._store = store  # keep the client (and for rank 0 the server) alive with the group
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(group_name, store), rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: object = None) -> torch.Tensor:
        self.pg.broadcast(tensor, src).wait()
        return tensor


def stateless_gloo_group(master_address: str, master_port: int, rank: int, world_size: int,
                         group_name: str = "openrlhf") -> StatelessGlooGroup:
    return StatelessGlooGroup(master_address, master_port, rank, world_size, group_name)


class LocalRanks:
    """The ``n`` consecutive ranks of one engine in the update group, served by one process."""

    def __init__(self, members: list[StatelessGlooGroup], pool: ThreadPoolExecutor):
        self.members = members
        self._pool = pool

    @classmethod
    async def join(cls, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, n: int) -> "LocalRanks":
        if rank_offset < 1 or rank_offset + n > world_size:
            raise ValueError(f"ranks {rank_offset}..{rank_offset + n - 1} do not fit a group of {world_size}")
        pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="pat-update-group")
        loop = asyncio.get_running_loop()
        members = await asyncio.gather(*[
            loop.run_in_executor(pool, StatelessGlooGroup, master_address, master_port, rank_offset + i,
                                 world_size, group_name)
            for i in range(n)
        ])
        return cls(list(members), pool)

    async def receive(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Take part in one broadcast from rank 0 on every local rank; return the tensor once."""
        loop = asyncio.get_running_loop()

        def recv(member: StatelessGlooGroup) -> torch.Tensor:
            return member.broadcast(torch.empty(shape, dtype=dtype), src=0)

        received = await asyncio.gather(*[loop.run_in_executor(self._pool, recv, m) for m in self.members])
        return received[0]

    def close(self) -> None:
        self._pool.shutdown(wait=False)
