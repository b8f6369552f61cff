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

``STATELESS_NCCL`` is the other kind a trainer builds: OpenRLHF's
``stateless_init_process_group`` is vLLM's ``StatelessProcessGroup`` (a
TCPStore, rank 0 hosting) plus a ``PyNcclCommunicator`` whose NCCL unique id
travels through that store. Torch's NCCL group cannot meet it (it exchanges
its id under other keys), so workers join it with vLLM's own classes; that
needs vLLM installed where the engine runs, and CUDA.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

STATELESS_NCCL = "stateless_nccl"
BACKENDS = ("gloo", "nccl", STATELESS_NCCL)
CUDA_ONLY = ("nccl", STATELESS_NCCL)


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


def join_stateless_nccl(master_address: str, master_port: int, rank: int, world_size: int,
                        device: torch.device) -> Any:
    """Join an OpenRLHF-style group (vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator``) on ``device``;
    returns the communicator (its ``broadcast(tensor, src, stream)`` is what ``receive_broadcast`` calls)."""
    if device.type != "cuda":
        raise ValueError(f"{STATELESS_NCCL!r} needs a CUDA device, not {device}")
    try:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
    except ImportError as exc:
        raise ImportError(f"backend {STATELESS_NCCL!r} joins the trainer's group with vLLM's StatelessProcessGroup "
                          f"and PyNcclCommunicator (as OpenRLHF's trainer builds it): install vllm ({exc})") from None
    pg = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank, world_size=world_size)
    return PyNcclCommunicator(pg, device=device)


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> the floating-point torch dtype; ValueError otherwise."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{name!r} is not a floating-point torch dtype")
    return dtype


def receive_broadcast(pg: Any, names: list[str], dtypes: list[str], shapes: list[list[int]],
                      device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Take part in one broadcast from rank 0 per tensor, in order; returns the full tensors.
    ``pg``: a torch ``ProcessGroup`` or a ``PyNcclCommunicator`` (``join_stateless_nccl``)."""
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        tensor = torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=device)
        if isinstance(pg, dist.ProcessGroup):
            dist.broadcast(tensor, src=0, group=pg)
        else:
            pg.broadcast(tensor, src=0, stream=torch.cuda.current_stream(device))
        out.append((name, tensor))
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # PyNccl returns once the broadcast is queued on the stream
    return out
