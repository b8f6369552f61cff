"""``WeightSync``: an RL weight update, its checks and batching on the caller's thread, its calls in the loop.

Weights arrive as full Hugging Face-named tensors (as a trainer holds them);
every rank slices its own shard under whatever layout is current, so an
update after a live switch lands correctly. The caller's thread walks the
tensor iterator (a trainer's generator may run collectives) and hands the
engine loop one bucket at a time (``_at_step_boundary``: drain, then the
worker call), so the full model is never held twice. A colocated trainer's
buckets may come by handle instead (``from_handles``: the workers rebuild
them, see ``model/weight_handles.py``). ``Engine``'s weight methods delegate here.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence, TypeVar, Union

import torch

from pat_engine.config import EngineConfig
from pat_engine.core.loop_thread import LoopThread, on_loop
from pat_engine.core.served_weights import ServedWeights
from pat_engine.core.sleep_state import SleepState
from pat_engine.core.stepping import Stepping
from pat_engine.errors import InvalidRequestError, ModelLoadError, WorkerFailure
from pat_engine.model.arch import ModelArch, load_model_arch
from pat_engine.model.llama import CausalLM
from pat_engine.model.weights import WeightNameCheck, byte_buckets, safetensors_files
from pat_engine.parallel.update_group import BACKENDS, CUDA_ONLY, parse_dtype
from pat_engine.protocol.calls import (
    DestroyWeightsUpdateGroup, InitWeightsUpdateGroup, LoadWeights, LoadWeightsFromHandles, ReloadWeights,
    UpdateWeightsFromDistributed, WorkerCall,
)

DEFAULT_BUCKET_BYTES = 256 << 20
HandleBucket = Union[bytes, Sequence[bytes]]  # one payload for every worker, or one per worker rank
R = TypeVar("R")


def _buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], limit: int, check: WeightNameCheck) -> Iterator[list]:
    def checked() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            check.check(name, tuple(tensor.shape))
            tensor = tensor.detach()
            yield name, tensor.contiguous() if tensor.device.type == "cpu" else tensor

    return byte_buckets(checked(), limit)


def _refused(exc: WorkerFailure) -> Exception:
    """A worker's refusal of a bucket (bad handle, unknown name, wrong shape) as the driver-side error
    the other update paths raise; any other failure unchanged."""
    kind = {"InvalidRequestError": InvalidRequestError, "ModelLoadError": ModelLoadError}.get(exc.error_type or "")
    if kind is None:
        return exc
    reason = str(exc).splitlines()[0].split(": ", 1)[-1]  # "<call> failed on rank r: <module.Error>: <why>"
    return kind(reason.split(": ", 1)[-1])


class WeightSync:
    def __init__(self, arch: ModelArch, config: EngineConfig, stepping: Stepping, weights: ServedWeights,
                 sleep: SleepState, thread: LoopThread) -> None:
        self.arch, self.config, self.stepping, self.weights = arch, config, stepping, weights
        self.sleep = sleep  # weights are written in place: refused while released
        self.thread = thread
        self._names: WeightNameCheck | None = None

    def name_check(self) -> WeightNameCheck:
        """The served model's tensor names and full shapes (a meta-device model: no memory)."""
        if self._names is None:
            self._names = WeightNameCheck(CausalLM(self.arch, 1, torch.float32, "meta"))
        return self._names

    def check_update(self, names: list[str], shapes: list[tuple[int, ...]], dtypes: list) -> None:
        """Refuse a whole update before anything is applied: an unknown name, a wrong shape, a dtype
        that is not floating point, or lists of different lengths (``InvalidRequestError`` names it)."""
        if not len(names) == len(shapes) == len(dtypes):
            raise InvalidRequestError(f"names, shapes and dtypes differ in length ({len(names)}, {len(shapes)}, "
                                      f"{len(dtypes)})")
        check = self.name_check()
        for name, shape, dtype in zip(names, shapes, dtypes):
            try:
                dt = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype)
                if not dt.is_floating_point:
                    raise ValueError(f"{dt} is not a floating-point dtype")
                check.check(name, tuple(shape))
            except (ValueError, ModelLoadError) as exc:
                raise InvalidRequestError(f"weight {name!r}: {exc}") from None

    def check_resident(self) -> None:
        """Weights are written in place: refuse while ``sleep`` has them released (wake_up first)."""
        state = self.sleep.weights
        if state is not None:
            raise InvalidRequestError(f"the weights are released ({state}); call wake_up(['weights']) before "
                                      "updating them")

    def from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                     version: str | None) -> int:
        self.check_resident()
        applied = self._in_buckets(_buckets(named_tensors, bucket_bytes, self.name_check()),
                                   lambda bucket: self._at_step_boundary(LoadWeights(bucket)))
        self.new_version(version)
        return applied

    def from_handles(self, buckets: Iterable[HandleBucket], version: str | None, final: bool) -> int:
        """Buckets of tensors shared by handle, one in flight; ``final``: the update is whole, count a version."""
        self.check_resident()

        def send(bucket: HandleBucket) -> int:
            one = isinstance(bucket, (bytes, bytearray, memoryview))
            try:
                return self._at_step_boundary(LoadWeightsFromHandles([bytes(bucket)] if one else
                                                                     [bytes(p) for p in bucket]))
            except WorkerFailure as exc:
                raise _refused(exc) from None

        applied = self._in_buckets(buckets, send)
        if final:
            self.new_version(version)
        return applied

    def _in_buckets(self, buckets: Iterable, send) -> int:
        """Apply ``buckets`` one at a time (``send`` returns the tensors applied); a failure after the first
        bucket, in the workers or in checking a later bucket, leaves the model part old, part new: marked."""
        applied = done = 0
        try:
            for bucket in buckets:
                applied += send(bucket)
                done += 1
                self.weights.updated_in_memory()
        except BaseException:
            if done:
                self.weights.update_failed()
            raise
        return applied

    def from_disk(self, path: str, version: str | None) -> None:
        self.check_resident()
        arch = load_model_arch(path)
        if arch.fingerprint() != self.arch.fingerprint():
            raise ModelLoadError(f"{path!r} is a different model (architecture or shapes differ from the served one)")
        safetensors_files(path)
        self._at_step_boundary(ReloadWeights(str(path)))
        self.weights.updated_from_disk(str(path))
        self.new_version(version)

    def join_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
                   backend: str | None, timeout_s: float | None) -> None:
        world = self.config.world
        backend = backend or ("nccl" if self.config.device == "cuda" else "gloo")
        if backend not in BACKENDS:
            raise InvalidRequestError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend in CUDA_ONLY and self.config.device != "cuda":
            raise InvalidRequestError(f"backend {backend!r} needs an engine on CUDA devices; this one runs on "
                                      f"{self.config.device}: use backend='gloo'")
        if rank_offset < 1 or rank_offset + world > world_size:
            raise InvalidRequestError(f"ranks {rank_offset}..{rank_offset + world - 1} of this engine's {world} "
                                      f"workers do not fit a group of {world_size} (rank 0 is the trainer)")
        # every worker joins as rank ``rank_offset + its rank``; blocks until all have (and the trainer)
        self._ask(InitWeightsUpdateGroup(master_address, int(master_port), rank_offset, world_size, group_name,
                                         backend, timeout_s or self.config.collective_timeout_s))

    def from_distributed(self, names: list[str], dtypes: list, shapes: list[list[int]], group_name: str,
                         version: str | None, timeout_s: float | None, final: bool = True) -> int:
        self.check_resident()
        self.check_update(names, [tuple(s) for s in shapes], dtypes)
        applied = self._at_step_boundary(UpdateWeightsFromDistributed(
            list(names), [str(d) for d in dtypes], [list(s) for s in shapes], group_name, timeout_s))
        self.weights.updated_in_memory()
        if final:
            self.new_version(version)
        return applied

    def leave_group(self, group_name: str) -> bool:
        return self._ask(DestroyWeightsUpdateGroup(group_name))

    # ---- in the loop thread ------------------------------------------------------------------

    @on_loop
    def _at_step_boundary(self, call: WorkerCall[R]) -> R:
        """``call`` on every rank once no step is in flight: weights are written in place."""
        self.stepping.drain()
        return self.stepping.pool.ask(call)

    @on_loop
    def _ask(self, call: WorkerCall[R]) -> R:
        return self.stepping.pool.ask(call)

    @on_loop
    def new_version(self, version: str | None) -> str:
        """Count one finished update; unfinished requests note from which token the new weights apply.
        The prefix cache is dropped: its blocks hold KV the old weights computed."""
        self.stepping.flush_prefix_cache()
        name = self.weights.new_version(version)
        for seq in self.stepping.seqs.values():
            seq.note_new_weights(name)
        return name
