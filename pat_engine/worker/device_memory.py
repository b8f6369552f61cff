"""One rank's device memory: its share of the GPU (checked at start-up), the KV budget measured from that
share, and the allocator counters the ``Stats`` call reports (a leak check compares two of them).

The rules themselves (placement, shares, the budget formula) are pure functions in parallel/devices.py;
this module only reads the device for them.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pat_engine.config import EngineConfig
from pat_engine.parallel.devices import DevicePlacement, check_share, rank_kv_budget


@dataclass(frozen=True)
class RankMemory:
    """A GPU rank's memory share: ``fraction`` of its device, which ``sharing`` ranks use (itself included)."""

    device: torch.device
    fraction: float
    sharing: int

    @classmethod
    def at_start(cls, cfg: EngineConfig, placement: DevicePlacement, rank: int, device: torch.device,
                 weight_bytes: int) -> RankMemory:
        """The share, refused by name (before anything is loaded) when it cannot hold the weights and the
        configured KV."""
        fraction = placement.memory_fraction(cfg.gpu_memory_utilization, cfg.rank_memory_fraction)
        check_share(fraction, torch.cuda.get_device_properties(device).total_memory, weight_bytes, cfg.kv_cache_bytes)
        return cls(device, fraction, placement.sharing(rank))

    def kv_budget(self, reserve: int) -> int:
        """Bytes this rank can give its KV pool now (every rank of the device holds its weights, none a pool)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # what loading left cached is not in use: measure without it
        free, total = torch.cuda.mem_get_info(self.device)
        return rank_kv_budget(total, free, self.fraction, self.sharing, reserve)


def storage_view(old: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A contiguous ``shape`` tensor over ``old``'s memory from its first byte, or None where ``old`` does not
    start its storage, has another dtype, or the storage is too small. A switch puts each new weight shard
    and KV layer there (switch_executor.into_own_storage, PagedKVPool.append_layer_from), so every address a
    decode graph reads stays put across layouts (graph_capture.py)."""
    storage = old.untyped_storage()
    if old.dtype != dtype or old.storage_offset() != 0 or storage.nbytes() < math.prod(shape) * dtype.itemsize:
        return None
    return torch.empty(0, dtype=dtype, device=old.device).set_(storage, 0, shape)


def release_cached(device: torch.device | str) -> None:
    """Return this process's unused cached memory: on a GPU the caching allocator's free blocks to the device
    (it keeps a freed block until its own process runs out; ranks sharing a GPU cannot take it then), on the CPU
    the C heap's free pages to the OS (a CPU worker's heap keeps what it frees up to its trim threshold:
    ``EngineConfig.worker_env``)."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    elif torch.device(device).type == "cpu" and (trim := _malloc_trim()) is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None under another C library)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def allocator_stats(device: torch.device, release: bool = False) -> dict:
    """This rank's CUDA caching-allocator counters in bytes (None on the CPU): what its tensors hold
    (``allocated``), what the allocator keeps from the device (``reserved``), and the peak allocated.
    ``release`` first returns the unused cached blocks: a dropped epoch of decode graphs leaves its
    memory pool cached until then, which is not a leak."""
    if device.type != "cuda":
        return {"allocated": None, "reserved": None, "peak_allocated": None}
    torch.cuda.synchronize(device)
    if release:
        release_cached(device)
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
            "peak_allocated": torch.cuda.max_memory_allocated(device)}
