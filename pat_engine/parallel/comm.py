"""Handle on one tensor-parallel group: the collectives the model layers call.

Layers get this handle through the forward context instead of reading
``torch.distributed`` globals, so a layout switch only swaps the handle.
On CPU workers of one host the collectives go through shared memory
(parallel/shm_collectives.py) when the tensor fits its slots, else through gloo.
Ranks that share a GPU (parallel/devices.py) cannot use NCCL: their group is ``host_staged``.
Its collectives read each other's device memory (parallel/ipc_collectives.py) when the tensor fits
those slots; otherwise (or with ``PAT_COLOCATED_COLLECTIVES=host``) each runs the CPU path above on a
host copy of the CUDA tensor and copies the result back. Either way the host takes part in every
collective, so no CUDA graph can record them (``graphs_capturable``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pat_engine.parallel.devices import graphs_capturable
from pat_engine.parallel.ipc_collectives import HOST_STAGED, IPC, IpcChannel
from pat_engine.parallel.shm_collectives import ShmChannel


# torch 2.13 renamed all_gather_into_tensor (now deprecated); a CUDA build of an older torch has only that
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class TPGroup:
    rank: int  # rank inside the group (= shard index)
    size: int
    ranks: tuple[int, ...]  # global ranks, in TP-rank order
    device_group: object | None = field(default=None, repr=False)  # nccl on GPU, gloo on CPU; None for one rank
    shm: ShmChannel | None = field(default=None, repr=False)  # CPU, one host: the shared-memory path
    ipc: IpcChannel | None = field(default=None, repr=False)  # ranks sharing a GPU: each other's device memory
    host_staged: bool = False  # ranks sharing a GPU (no NCCL): CUDA tensors the IPC slots cannot take go by host

    @property
    def graphs_capturable(self) -> bool:
        """Whether a CUDA graph can record this group's collectives (parallel/devices.py)."""
        return graphs_capturable(self.size, self.host_staged)

    @property
    def collectives(self) -> str:
        """The path a decode step's collectives take, for stats and results: "none" (one rank, or no
        communicator: pat-profile's emulated shards), "ipc", "host-staged", "shm" or the backend's name."""
        if self.size == 1 or self.device_group is None:
            return "none"
        if self.ipc is not None:
            return IPC
        if self.host_staged:
            return HOST_STAGED
        return "shm" if self.shm is not None else dist.get_backend(self.device_group)

    def _staged(self, x: torch.Tensor) -> bool:
        return self.host_staged and x.device.type != "cpu"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            if self.ipc is not None and self.ipc.fits(x):
                return self.ipc.all_reduce(x)
            if self._staged(x):
                return x.copy_(self.all_reduce(x.cpu()))
            if self.shm is not None and self.shm.fits(x):
                return self.shm.all_reduce(x)
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` stacked in TP-rank order: ``(size, *x.shape)``, the same on every rank.
        Moves bits only (no sum), so a caller can add the parts in an order of its own."""
        if self.size == 1:
            return x.unsqueeze(0)
        if self.ipc is not None and self.ipc.fits(x):
            return self.ipc.all_gather(x)
        if self._staged(x):
            return self.all_gather(x.cpu()).to(x.device)
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_gather(x)
        flat = x.contiguous().view(-1)  # gloo wants the output as the inputs concatenated on dim 0
        out = torch.empty(self.size * flat.numel(), dtype=x.dtype, device=x.device)
        _all_gather_single(out, flat, group=self.device_group)  # gloo and NCCL alike, no host copy
        return out.view(self.size, *x.shape)

    def gather_to_leader(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """TP rank 0 gets every rank's ``x`` concatenated along ``dim``; others get None."""
        if self.size == 1:
            return x
        if self.ipc is not None and self.ipc.fits(x):
            return self.ipc.gather(x, dim)
        if self._staged(x):
            out = self.gather_to_leader(x.cpu(), dim)
            return None if out is None else out.to(x.device)
        if self.shm is not None and self.shm.fits(x):
            return self.shm.gather(x, dim)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, group=self.device_group, group_dst=0)
        return torch.cat(parts, dim=dim) if parts is not None else None
