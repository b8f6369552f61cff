"""A weight-update group between a trainer and the engine's workers (SGLang's ``init_weights_update_group``).

The trainer is rank 0 and hosts the rendezvous (a TCPStore at
``master_address:master_port``); worker ``r`` of the engine joins as
``rank_offset + r``. The group is built the way SGLang's and slime's
``init_custom_process_group`` build theirs (a ``tcp://`` rendezvous, the
store prefixed with the group name, then ``_new_process_group_helper``) so
that a trainer using their helper and a pat worker meet on the same keys.
It is a second group next to the engine's own world, which it never touches.
``_new_process_group_helper`` is private torch API, the same one those
frameworks rely on: it is the only way to build a named group without making
it the process's default group.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

BACKENDS = ("gloo", "nccl")


def join_update_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                      backend: str, timeout_s: float) -> dist.ProcessGroup:
    """Join (rank 0: host) the named group; returns once every rank has joined."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                           group_name=group_name, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # group rank i is "global" rank i here
    return pg


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> the floating-point torch dtype; ValueError otherwise."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{name!r} is not a floating-point torch dtype")
    return dtype


def receive_broadcast(pg: dist.ProcessGroup, names: list[str], dtypes: list[str], shapes: list[list[int]],
                      device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Take part in one broadcast from rank 0 per tensor, in order; returns the full tensors."""
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        tensor = torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=device)
        dist.broadcast(tensor, src=0, group=pg)
        out.append((name, tensor))
    return out
