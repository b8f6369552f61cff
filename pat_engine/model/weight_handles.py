"""Named tensors passed by handle, for a trainer that shares the engine's devices (colocated RL).

The trainer pickles ``[(hf_name, tensor), ...]`` by handle (pat_engine/tensor_handles.py: a CUDA
tensor becomes a CUDA IPC handle, its GPU named by UUID, a CPU tensor a shared-memory file name).
The bytes are small; the driver forwards them untouched and every worker rebuilds the handles itself,
then copies only its own shard (``load_shard_from_tensors``), so a full tensor never passes through
the driver. The trainer must keep the tensors alive until the engine call that takes them returns.

A payload entry's tensor may also be per source (built by adapters):
``RankHandles`` (SGLang's ``LocalSerializedTensor``: entry ``i`` from trainer
rank ``i``; worker ``r`` opens entry ``r % len``) or ``DeviceHandles``
(OpenRLHF's ``ipc_handles``: keyed by physical device; a worker opens the one
on its own device). Workers unpickle with tensor_handles' allowlist and these two classes: a payload
cannot name other code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

from pat_engine.errors import InvalidRequestError
from pat_engine.model.weights import byte_buckets
from pat_engine.tensor_handles import device_key, rebuild, serialize

__all__ = ["RankHandles", "DeviceHandles", "serialize", "serialize_named_tensors", "serialize_buckets",
           "serialize_reduced", "device_key", "load_named_tensors"]


@dataclass
class RankHandles:
    """One serialized tensor per trainer rank (pickles like SGLang's ``LocalSerializedTensor``)."""

    values: list[bytes] = field(default_factory=list)


@dataclass
class DeviceHandles:
    """One serialized tensor per physical device (``device_key``), as OpenRLHF's ``ipc_handles``."""

    values: dict[str, bytes] = field(default_factory=dict)


class _Rebuild:
    """Pickles as the call ``fn(*args)``: turns a ``reduce_tensor`` output back into bytes to rebuild."""

    def __init__(self, fn: Callable, args: tuple) -> None:
        self.fn, self.args = fn, tuple(args)

    def __reduce__(self) -> tuple:
        return self.fn, self.args


def serialize_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """Trainer side: one payload (one bucket) of full Hugging Face-named tensors, by handle."""
    return serialize([(str(name), tensor.detach()) for name, tensor in named_tensors])


def serialize_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[bytes]:
    """Trainer side: one payload per bucket of about ``bucket_bytes``. A bucket's tensors stay alive
    (in this generator) until the next payload is asked for, that is until the engine took this one."""
    for bucket in byte_buckets(named_tensors, bucket_bytes):
        yield serialize_named_tensors(bucket)


def serialize_reduced(reduced: tuple[Callable, tuple]) -> bytes:
    """A ``reduce_tensor`` output (``(rebuild_fn, args)``, as OpenRLHF sends) as bytes to rebuild."""
    fn, args = reduced
    return serialize(_Rebuild(fn, args))  # a CPU reduction still holds its storage: share it by name


# ---- worker side ---------------------------------------------------------------------------------

_PER_SOURCE = {
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"): RankHandles,
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): RankHandles,
    (__name__, "RankHandles"): RankHandles,
    (__name__, "DeviceHandles"): DeviceHandles,
}


def _rebuild(data: bytes, first_reader: bool, own_device: torch.device | None = None) -> Any:
    return rebuild(data, first_reader, own_device, _PER_SOURCE)


def _resolve(value: Any, rank: int, device: torch.device) -> torch.Tensor:
    if isinstance(value, RankHandles):
        if not value.values:
            raise InvalidRequestError("a per-rank tensor entry holds no handles")
        value = _rebuild(value.values[rank % len(value.values)], rank < len(value.values))
    elif isinstance(value, DeviceHandles):
        key = device_key(device)
        if key not in value.values:
            raise InvalidRequestError(f"no handle for this worker's device {key!r} (got {sorted(value.values)})")
        on_gpu = device.type == "cuda"  # one worker per GPU; on CPU every worker reads the "cpu" entry
        value = _rebuild(value.values[key], on_gpu or rank == 0, device if on_gpu else None)
    if not isinstance(value, torch.Tensor):
        raise InvalidRequestError(f"a weight payload entry rebuilt to {type(value).__name__}, not a tensor")
    return value


def load_named_tensors(payloads: list[bytes], rank: int, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Worker side: rebuild worker ``rank``'s payload (``payloads[rank % len]``) into full named tensors
    that view the trainer's memory (nothing is copied here)."""
    if not payloads:
        raise InvalidRequestError("no weight payload")
    obj = _rebuild(payloads[rank % len(payloads)], rank < len(payloads))
    if not isinstance(obj, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2
                                                     and isinstance(p[0], str) for p in obj):
        raise InvalidRequestError("a weight payload must hold a list of (name, tensor) pairs")
    return [(name, _resolve(value, rank, device)) for name, value in obj]
