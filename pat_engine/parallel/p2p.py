"""Point-to-point exchange of packed buffers between ranks of the one world: a switch's weights and KV.

Three paths (``path_for`` picks one per world; ``PAT_SWITCH_P2P``, pat_engine/env.py):

- ``direct``: the backend sends the tensors as they are (NCCL between GPUs, gloo on the CPU).
- ``host``: ranks that share a GPU have no NCCL (parallel/devices.py), and gloo carries host memory only,
  so CUDA buffers travel as host copies: 0.35 GB/s a rank on the fourth H100 run, where a co-located
  switch of a 1B model spent 3.6 of its 4.0 s sending weights.
- ``handles``: each sender passes a handle to its buffer (a CUDA IPC handle, or on the CPU a
  shared-memory file name; pat_engine/tensor_handles.py) and each receiver copies from the sender's memory
  itself: for ranks on one GPU a device-to-device copy, the traffic an NVLink switch would see at HBM
  rather than host speed. The handles (a few hundred bytes) go through gloo.

The ``handles`` protocol, for every pair at once: the sender finishes writing its buffers (its device
synchronised) before it hands them out; the receiver copies, synchronises its own device, drops its view
and only then acknowledges; the sender returns only after every acknowledgement, so the caller may free
or overwrite its buffers as soon as ``exchange`` returns, as with the other two paths.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pat_engine import env
from pat_engine.tensor_handles import rebuild_tensor, serialize

DIRECT, HOST, HANDLES = "direct", "host", "handles"
PATHS = (DIRECT, HOST, HANDLES)


def path_for(host_staged: bool) -> str:
    """The path a world takes: ``host_staged`` (ranks sharing a GPU) by handle unless ``PAT_SWITCH_P2P=host``
    stages through the host; any other world directly unless ``PAT_SWITCH_P2P=handles`` (tests)."""
    asked = env.switch_p2p()
    if asked == HANDLES:
        return HANDLES
    if not host_staged:
        return DIRECT
    return HOST if asked == HOST else HANDLES


def check_path(path: str, host_staged: bool) -> None:
    """Refuse, by name, a path this world cannot take: ``direct`` where the ranks share a GPU (gloo would be
    handed CUDA tensors)."""
    if path not in PATHS:
        raise ValueError(f"unknown point-to-point path {path!r}; one of {', '.join(PATHS)}")
    if path == DIRECT and host_staged:
        raise ValueError("ranks sharing a GPU cannot send CUDA tensors directly (gloo): use 'host' or 'handles'")


def exchange(sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], path: str = DIRECT) -> None:
    """Send ``sends[dst]`` to each dst and fill ``recvs[src]`` (same numel and dtype) from each src, all at
    once, along ``path``.

    Both sides iterate peers in ascending order, so the (single) message per pair matches without tags.
    """
    if path == HANDLES:
        _exchange_by_handle(sends, recvs)
        return
    if path == HOST and any(t.device.type != "cpu" for t in [*sends.values(), *recvs.values()]):
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


def _exchange_by_handle(sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> None:
    shared = {d: t.contiguous() for d, t in sends.items()}  # kept alive until every peer has copied
    _settle(shared.values())
    blobs = {d: torch.frombuffer(bytearray(serialize(t)), dtype=torch.uint8) for d, t in shared.items()}
    sizes = {s: torch.zeros(1, dtype=torch.int64) for s in recvs}
    exchange({d: torch.tensor([b.numel()]) for d, b in blobs.items()}, sizes)
    got = {s: torch.empty(int(n), dtype=torch.uint8) for s, n in sizes.items()}
    exchange(blobs, got)
    for src, out in recvs.items():
        peer = rebuild_tensor(got[src].numpy().tobytes())
        if peer.numel() != out.numel() or peer.dtype != out.dtype:
            raise RuntimeError(f"rank {src} sent {peer.numel()} x {peer.dtype} where {out.numel()} x {out.dtype} "
                               "was expected: the two sides planned different exchanges")
        out.copy_(peer.view(out.shape))
        del peer
    _settle(recvs.values())
    exchange({s: torch.ones(1, dtype=torch.uint8) for s in recvs},  # done reading: the senders may reuse
             {d: torch.empty(1, dtype=torch.uint8) for d in shared})
    if any(t.is_cuda for t in shared.values()):
        torch.cuda.ipc_collect()  # memory torch held back for peers that have let go


def _settle(tensors) -> None:
    """Wait for this process's work on each CUDA tensor's device, every stream (nothing on the CPU)."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.synchronize(device)
