"""Which device each rank runs on, its share of that device's memory, and which backend its collectives use.

One rank per GPU is the deployment this engine is built for: NCCL collectives, CUDA graphs over them.
When the world has more ranks than the host shows GPUs (a one-GPU machine running TP1xDP2 -> TP2xDP1 to
test and measure the switch), several ranks share a device. That is a test and development mode, labelled
as such wherever it runs:

- **placement**: rank ``r`` runs on device ``r % devices`` (so ranks spread before any device takes a second);
- **memory**: each rank may use an explicit fraction of its device (``rank_memory_fraction``, by default
  ``gpu_memory_utilization`` split equally among the most ranks any device holds). Ranks size their KV
  from that share and agree on the smallest pool, so every rank holds a pool of the same size;
- **collectives**: NCCL refuses two ranks on one device ("Duplicate GPU detected"), so such a world runs
  gloo (``host_staged``): a TP group's collectives read each other's device memory, mapped by CUDA IPC
  handle (parallel/ipc_collectives.py), or go on host copies of the CUDA tensors (tensors over a slot,
  ``PAT_COLOCATED_COLLECTIVES=host``). Either way one device's speed, not NVLink's: such a run proves a
  switch's mechanics (tokens, memory, graph recapture), not its communication cost. A switch's weights
  and KV pass by CUDA IPC handle too (parallel/p2p.py);
- **graphs**: a co-located collective cannot be recorded in a CUDA graph (on either path the host waits
  for the device and exchanges with its peers), and a spinning cross-process wait on one device without
  MPS can deadlock a captured graph. So a co-located TP group of more than one rank decodes eagerly; TP1
  groups (no collective) keep their graphs (``graphs_capturable``).

Pure functions of counts: the driver places the world once (core/worker_pool.py hands each worker its
``DevicePlacement``; predictor/deployment.py names a co-located deployment in its tables), the worker
start-up applies it (worker/worker.py, worker/device_memory.py), and the CPU tests check it without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pat_engine.errors import InvalidRequestError


@dataclass(frozen=True)
class DevicePlacement:
    """Where the ``world`` ranks run on the ``devices`` GPUs this host shows (0: CPU workers)."""

    world: int
    devices: int

    def __post_init__(self) -> None:
        if self.world < 1 or self.devices < 0:
            raise ValueError(f"a placement needs world >= 1 and devices >= 0, got {self.world}, {self.devices}")

    def device_index(self, rank: int) -> int:
        """The CUDA device index rank ``rank`` uses (0 on the CPU)."""
        self._check(rank)
        return rank % self.devices if self.devices else 0

    def sharing(self, rank: int) -> int:
        """Ranks on ``rank``'s device, itself included (1 on the CPU, where each rank is its own process)."""
        self._check(rank)
        if not self.devices:
            return 1
        index = self.device_index(rank)
        return len(range(index, self.world, self.devices))

    @property
    def most_sharing(self) -> int:
        """The most ranks any one device holds."""
        return math.ceil(self.world / self.devices) if self.devices else 1

    @property
    def colocated(self) -> bool:
        """Whether some GPU holds more than one rank (the test and development mode above)."""
        return self.most_sharing > 1

    @property
    def device_backend(self) -> str:
        """The backend of the world's device collectives: NCCL with one rank per GPU, else gloo."""
        return "nccl" if self.devices and not self.colocated else "gloo"

    @property
    def host_staged(self) -> bool:
        """Whether collectives on CUDA tensors go through host copies (gloo carries host memory only)."""
        return bool(self.devices) and self.device_backend == "gloo"

    def memory_fraction(self, utilization: float, per_rank: float | None) -> float:
        """The fraction of its device's memory each rank may use: ``per_rank`` when given, else
        ``utilization`` split equally among the most ranks a device holds. Ranks asking more than a whole
        device between them are refused."""
        if per_rank is None:
            return utilization / self.most_sharing
        if per_rank * self.most_sharing > 1.0 + 1e-9:
            raise InvalidRequestError(
                f"rank_memory_fraction={per_rank} x {self.most_sharing} ranks on one device asks for "
                f"{per_rank * self.most_sharing:.2f} of the device; at most {1 / self.most_sharing:.3f} per rank fits")
        return per_rank

    def describe(self) -> str:
        """One line for logs and results: where the ranks run and what that means."""
        if not self.devices:
            return f"{self.world} CPU worker process(es)"
        if not self.colocated:
            return f"{self.world} rank(s), one per CUDA device (NCCL)"
        return (f"{self.world} ranks on {self.devices} CUDA device(s), up to {self.most_sharing} per device: "
                f"co-located test/dev mode (collectives through each other's device memory or host copies, not "
                f"NVLink; TP>1 groups decode without CUDA graphs)")

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a world of {self.world}")


def graphs_capturable(tp_size: int, host_staged: bool) -> bool:
    """Whether a CUDA graph can record a TP group's decode forward: a group without collectives (one rank),
    or one whose collectives are device work (NCCL). Host-staged collectives are not (module docstring)."""
    return tp_size == 1 or not host_staged


def rank_kv_budget(total: int, free: int, fraction: float, sharing: int, reserve: int) -> int:
    """Bytes one rank can give its KV pool, measured once every rank of the device holds its weights and
    none holds a pool yet.

    ``total`` and ``free``: the device's memory and what is free now; ``fraction``: this rank's share of
    ``total``; ``sharing``: the ranks on this device; ``reserve``: what the rank keeps beside the pool
    (activations, logits, graphs). What the device uses now (the ranks' weights and CUDA contexts, and any
    other process) is charged equally to the ranks that share it: with one rank and ``fraction`` equal to
    the utilisation this is the one-GPU rule, ``free - total * (1 - utilization) - reserve``.
    """
    if sharing < 1:
        raise ValueError(f"sharing must be >= 1, got {sharing}")
    used = total - free
    return max(0, int(total * fraction - used / sharing - reserve))


def check_share(fraction: float, total: int, weight_bytes: int, kv_bytes: int | None = None) -> None:
    """Refuse, by name, a memory share that cannot hold this rank's weights (and its configured KV)."""
    share = total * fraction
    need = weight_bytes + (kv_bytes or 0)
    if need > share:
        what = "its weights" + (f" ({weight_bytes / 2**30:.2f} GiB) and its KV ({kv_bytes / 2**30:.2f} GiB)"
                                if kv_bytes else f" ({weight_bytes / 2**30:.2f} GiB)")
        raise InvalidRequestError(
            f"a rank's memory share ({fraction:.3f} of {total / 2**30:.1f} GiB = {share / 2**30:.2f} GiB) cannot "
            f"hold {what}: raise rank_memory_fraction / gpu_memory_utilization, put fewer ranks on a device, "
            f"or use a higher TP")


def visible_devices(device: str) -> int:
    """CUDA devices this process sees (0 for the CPU)."""
    if device != "cuda":
        return 0
    import torch

    return torch.cuda.device_count()
