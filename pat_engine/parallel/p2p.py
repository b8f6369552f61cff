"""Point-to-point exchange of packed buffers between ranks of the one world."""

from __future__ import annotations

import torch
import torch.distributed as dist


def exchange(sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], host_staged: bool = False) -> None:
    """Send ``sends[dst]`` to each dst and fill ``recvs[src]`` from each src, all at once.

    Both sides iterate peers in ascending order, so the (single) message per
    pair matches without tags. ``host_staged`` (ranks sharing a GPU, parallel/devices.py): gloo
    carries host memory only, so CUDA buffers travel as host copies.
    """
    if host_staged and any(t.device.type != "cpu" for t in [*sends.values(), *recvs.values()]):
        staged = {s: torch.empty(t.shape, dtype=t.dtype) for s, t in recvs.items()}
        exchange({d: t.cpu() for d, t in sends.items()}, staged)
        for s, t in recvs.items():
            t.copy_(staged[s])
        return
    ops = [dist.P2POp(dist.isend, sends[d].contiguous(), d) for d in sorted(sends)]
    ops += [dist.P2POp(dist.irecv, recvs[s], s) for s in sorted(recvs)]
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()
