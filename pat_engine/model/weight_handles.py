"""Named tensors passed by handle, for a trainer that shares the engine's devices (colocated RL).

The trainer pickles ``[(hf_name, tensor), ...]`` with torch's multiprocessing
reductions (``ForkingPickler``, as SGLang's ``MultiprocessingSerializer`` and
OpenRLHF's ``update_weight_cuda_ipc`` do): a CUDA tensor becomes a CUDA IPC
handle (its GPU named by UUID: the trainer and a worker may number GPUs
differently), a CPU tensor a shared-memory file name. The bytes are small; the
driver forwards them untouched and every worker rebuilds the handles itself,
then copies only its own shard (``load_shard_from_tensors``), so a full tensor
never passes through the driver. The trainer must keep the tensors alive
until the engine call that takes them returns.

CPU handles use torch's ``file_system`` sharing strategy: a file name any
process on the host can open, any number of times. The default
``file_descriptor`` strategy passes a descriptor through a one-shot socket
that only a process with the sender's multiprocessing authkey may use, so it
fails for a trainer that did not spawn the engine, and for the second worker.

A payload entry's tensor may also be per source (built by adapters):
``RankHandles`` (SGLang's ``LocalSerializedTensor``: entry ``i`` from trainer
rank ``i``; worker ``r`` opens entry ``r % len``) or ``DeviceHandles``
(OpenRLHF's ``ipc_handles``: keyed by physical device; a worker opens the one
on its own device). Workers unpickle with an allowlist (torch's rebuild
functions, containers, these two classes): a payload cannot name other code.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import threading
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.multiprocessing as torch_mp
from torch.multiprocessing import reductions

from pat_engine.errors import InvalidRequestError
from pat_engine.model.weights import byte_buckets

CPU_SHARING = "file_system"
_STRATEGY_LOCK = threading.Lock()


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


@contextlib.contextmanager
def cpu_file_system_sharing() -> Iterator[None]:
    """Share CPU storages by file name while pickling (the strategy is process-wide: set, then restored)."""
    with _STRATEGY_LOCK:
        old = torch_mp.get_sharing_strategy()
        torch_mp.set_sharing_strategy(CPU_SHARING)
        try:
            yield
        finally:
            torch_mp.set_sharing_strategy(old)


def _reduce_by_uuid(tensor: torch.Tensor) -> tuple[Callable, tuple]:
    """``reduce_tensor``, with a CUDA handle's device named by GPU UUID instead of this process's index
    (as SGLang's patched reductions do): a worker that sees the GPU under another index finds it."""
    fn, args = reductions.reduce_tensor(tensor)
    if fn is reductions.rebuild_cuda_tensor:
        args = (*args[:_DEVICE_ARG], device_key(torch.device("cuda", args[_DEVICE_ARG])), *args[_DEVICE_ARG + 1:])
    return fn, args


def serialize(obj: Any) -> bytes:
    """``obj`` pickled with torch's reductions: tensors inside travel as handles, not values."""
    buf = io.BytesIO()
    with cpu_file_system_sharing():
        pickler = ForkingPickler(buf)
        pickler.dispatch_table.update({torch.Tensor: _reduce_by_uuid, torch.nn.Parameter: _reduce_by_uuid})
        pickler.dump(obj)
    return buf.getvalue()


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


def device_key(device: torch.device) -> str:
    """The key a worker looks for in ``DeviceHandles``: the GPU's UUID (OpenRLHF's
    ``get_physical_gpu_id``), or "cpu" for CPU workers."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).uuid)
    return device.type


# ---- worker side ---------------------------------------------------------------------------------

_TORCH_TYPES = {"Tensor", "Size", "device", "dtype", "UntypedStorage", "TypedStorage"}
_REBUILDS = {"rebuild_tensor", "rebuild_storage_empty", "rebuild_typed_storage",
             "rebuild_typed_storage_child", "rebuild_meta_tensor"}
_BUILTINS = {"list", "tuple", "dict", "str", "bytes", "int", "float", "bool", "slice"}
_PER_SOURCE = {
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"): RankHandles,
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): RankHandles,
    (__name__, "RankHandles"): RankHandles,
    (__name__, "DeviceHandles"): DeviceHandles,
}
_CUDA_REBUILDS = {("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
                  ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")}
_DEVICE_ARG = 6  # where reduce_tensor puts the CUDA device in rebuild_cuda_tensor's arguments


def _cuda_index(device: Any) -> int:
    """A device index, or a GPU UUID (``serialize`` and SGLang's patched reductions send one) -> this
    process's index of that GPU."""
    if not isinstance(device, str):
        return int(device)
    for i in range(torch.cuda.device_count()):
        if device_key(torch.device("cuda", i)).removeprefix("GPU-") == device.removeprefix("GPU-"):
            return i
    raise InvalidRequestError(f"no visible CUDA device has UUID {device!r}")


class _HandleUnpickler(pickle.Unpickler):
    """Rebuilds handles and nothing else.

    ``own_device``: rebuild CUDA handles there (the key already matched this worker's physical
    device, so its index in the sender's numbering does not apply). ``first_reader``: pickling a CPU
    storage takes one reference to its shared-memory file for the reader to drop; when several
    workers read one payload only the first may drop it, or the count reaches zero and the file is
    unlinked while the trainer still holds the tensor (a later reader, or a later payload of the
    same tensor, would find it gone).
    """

    def __init__(self, data: bytes, own_device: torch.device | None, first_reader: bool) -> None:
        super().__init__(io.BytesIO(data))
        self.own_device, self.first_reader = own_device, first_reader

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CUDA_REBUILDS:
            return self._rebuild_cuda
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_storage_filename"):
            return self._rebuild_shared_file
        if (module, name) in _PER_SOURCE:
            return _PER_SOURCE[(module, name)]
        allowed = ((module == "torch.multiprocessing.reductions" and name in _REBUILDS)
                   or (module in ("torch", "torch.storage") and (name in _TORCH_TYPES or isinstance(
                       getattr(torch, name, None), torch.dtype)))
                   or (module == "builtins" and name in _BUILTINS)
                   or (module, name) in (("torch.nn.parameter", "Parameter"), ("collections", "OrderedDict"),
                                         ("copyreg", "__newobj__")))
        if not allowed:
            raise InvalidRequestError(
                f"a weight payload names {module}.{name}; only torch tensor handles may be sent (CPU tensors "
                "with the file_system sharing strategy: pat_engine.model.weight_handles.serialize_named_tensors)")
        return super().find_class(module, name)

    def _rebuild_cuda(self, *args: Any) -> torch.Tensor:
        args = list(args)
        args[_DEVICE_ARG] = self.own_device.index if self.own_device is not None else _cuda_index(args[_DEVICE_ARG])
        return reductions.rebuild_cuda_tensor(*args)

    def _rebuild_shared_file(self, *args: Any) -> Any:
        storage = reductions.rebuild_storage_filename(*args)  # maps the file, drops the pickle's reference
        if not self.first_reader:
            storage._shared_incref()  # give it back: our own mapping still holds the file open meanwhile
        return storage


def _rebuild(data: bytes, first_reader: bool, own_device: torch.device | None = None) -> Any:
    try:
        return _HandleUnpickler(bytes(data), own_device, first_reader).load()
    except InvalidRequestError:
        raise
    except Exception as exc:  # a truncated payload, a shared-memory file already gone, a closed IPC handle
        raise InvalidRequestError(f"cannot rebuild a tensor handle: {type(exc).__name__}: {exc}") from None


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
