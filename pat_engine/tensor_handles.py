"""Tensors passed by handle between processes of one host: the bytes name memory, they do not carry it.

``serialize`` pickles with torch's multiprocessing reductions (``ForkingPickler``, as SGLang's
``MultiprocessingSerializer`` and OpenRLHF's ``update_weight_cuda_ipc`` do): a CUDA tensor becomes a
CUDA IPC handle (its GPU named by UUID: two processes may number GPUs differently), a CPU tensor a
shared-memory file name. ``rebuild`` turns the bytes back into tensors that view the sender's memory;
the sender must keep its tensors alive until the reader is done with them.

CPU handles use torch's ``file_system`` sharing strategy: a file name any process on the host can open,
any number of times. The default ``file_descriptor`` strategy passes a descriptor through a one-shot
socket that only a process with the sender's multiprocessing authkey may use, so it fails for a trainer
that did not spawn the engine, and for a second reader.

Readers unpickle with an allowlist (torch's rebuild functions, containers, and the classes a caller
adds): a payload cannot name other code. Two users: a trainer's weights (model/weight_handles.py) and
a switch's buffers between ranks (parallel/p2p.py).
"""

from __future__ import annotations

import contextlib
import io
import pickle
import threading
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as torch_mp
from torch.multiprocessing import reductions

from pat_engine.errors import InvalidRequestError

CPU_SHARING = "file_system"
_STRATEGY_LOCK = threading.Lock()
_DEVICE_ARG = 6  # where reduce_tensor puts the CUDA device in rebuild_cuda_tensor's arguments


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


def device_key(device: torch.device) -> str:
    """A device's name across processes: the GPU's UUID (OpenRLHF's ``get_physical_gpu_id``), or "cpu"."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).uuid)
    return device.type


def _reduce_by_uuid(tensor: torch.Tensor) -> tuple[Callable, tuple]:
    """``reduce_tensor``, with a CUDA handle's device named by GPU UUID instead of this process's index
    (as SGLang's patched reductions do): a reader that sees the GPU under another index finds it."""
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


# ---- reader side ---------------------------------------------------------------------------------

_TORCH_TYPES = {"Tensor", "Size", "device", "dtype", "UntypedStorage", "TypedStorage"}
_REBUILDS = {"rebuild_tensor", "rebuild_storage_empty", "rebuild_typed_storage",
             "rebuild_typed_storage_child", "rebuild_meta_tensor"}
_BUILTINS = {"list", "tuple", "dict", "str", "bytes", "int", "float", "bool", "slice"}
_CUDA_REBUILDS = {("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
                  ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")}


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
    """Rebuilds handles and nothing else (and the ``classes`` its caller allows, by (module, name)).

    ``own_device``: rebuild CUDA handles there (the caller already matched the sender's physical
    device, so its index in the sender's numbering does not apply). ``first_reader``: pickling a CPU
    storage takes one reference to its shared-memory file for the reader to drop; when several
    readers read one payload only the first may drop it, or the count reaches zero and the file is
    unlinked while the sender still holds the tensor (a later reader, or a later payload of the
    same tensor, would find it gone).
    """

    def __init__(self, data: bytes, own_device: torch.device | None, first_reader: bool,
                 classes: Mapping[tuple[str, str], type]) -> None:
        super().__init__(io.BytesIO(data))
        self.own_device, self.first_reader, self.classes = own_device, first_reader, classes

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CUDA_REBUILDS:
            return self._rebuild_cuda
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_storage_filename"):
            return self._rebuild_shared_file
        if (module, name) in self.classes:
            return self.classes[(module, name)]
        allowed = ((module == "torch.multiprocessing.reductions" and name in _REBUILDS)
                   or (module in ("torch", "torch.storage") and (name in _TORCH_TYPES or isinstance(
                       getattr(torch, name, None), torch.dtype)))
                   or (module == "builtins" and name in _BUILTINS)
                   or (module, name) in (("torch.nn.parameter", "Parameter"), ("collections", "OrderedDict"),
                                         ("copyreg", "__newobj__")))
        if not allowed:
            raise InvalidRequestError(
                f"a payload names {module}.{name}; only torch tensor handles may be sent (CPU tensors "
                "with the file_system sharing strategy: pat_engine.tensor_handles.serialize)")
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


def rebuild(data: bytes, first_reader: bool, own_device: torch.device | None = None,
            classes: Mapping[tuple[str, str], type] | None = None) -> Any:
    """What ``serialize`` pickled, its tensors viewing the sender's memory (nothing is copied)."""
    unpickler = _HandleUnpickler(bytes(data), own_device, first_reader, classes or {})
    try:
        return unpickler.load()
    except InvalidRequestError:
        raise
    except Exception as exc:  # a truncated payload, a shared-memory file already gone, a closed IPC handle
        raise InvalidRequestError(f"cannot rebuild a tensor handle: {type(exc).__name__}: {exc}") from None
    finally:
        # the memo holds find_class's bound methods (a cycle through the unpickler) and every rebuilt
        # storage: left to the garbage collector, a shared-memory file or a CUDA IPC mapping would outlive
        # its reader's use by however long the collector waits, past the process's end if it is killed
        unpickler.memo.clear()


def rebuild_tensor(data: bytes) -> torch.Tensor:
    """One tensor ``serialize`` sent to this reader alone (a peer rank's buffer, parallel/p2p.py)."""
    value = rebuild(data, first_reader=True)
    if not isinstance(value, torch.Tensor):
        raise InvalidRequestError(f"a handle rebuilt to {type(value).__name__}, not a tensor")
    return value
