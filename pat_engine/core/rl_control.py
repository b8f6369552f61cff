"""Engine methods an RL loop needs: weight sync, sleep/wake for colocation, pause/resume.

Weights arrive as full Hugging Face-named tensors (as a trainer holds them);
every rank slices its own shard under whatever layout is current, so an
update after a live switch lands correctly. The caller's thread walks the
tensor iterator (a trainer's generator may run collectives) and hands the
engine loop one bucket at a time, so the full model is never held twice.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch

from pat_engine.core.served_weights import ServedWeights
from pat_engine.core.sleep_state import DISCARDED, check_tags, tags_for_level
from pat_engine.errors import InvalidRequestError, ModelLoadError
from pat_engine.model.arch import load_model_arch
from pat_engine.model.llama import CausalLM
from pat_engine.model.weights import WeightNameCheck, safetensors_files
from pat_engine.parallel.update_group import BACKENDS, parse_dtype

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 << 20
PAUSE_MODES = ("in_place", "retract", "abort")


def _buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], limit: int, check: WeightNameCheck) -> Iterator[list]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        check.check(name, tuple(tensor.shape))
        tensor = tensor.detach()
        if tensor.device.type == "cpu":
            tensor = tensor.contiguous()
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= limit:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


class RLControlMixin:
    """Mixed into ``Engine``; uses its loop, coordinator, config and ``weights`` (``ServedWeights``)."""

    weights: ServedWeights

    def _weight_check(self) -> WeightNameCheck:
        if not hasattr(self, "_weight_check_cache"):
            self._weight_check_cache = WeightNameCheck(CausalLM(self.arch, 1, torch.float32, "meta"))
        return self._weight_check_cache

    def check_weight_update(self, names: list[str], shapes: list[tuple[int, ...]], dtypes: list) -> None:
        """Refuse a whole update before anything is applied: an unknown name, a wrong shape, a dtype
        that is not floating point, or lists of different lengths (``InvalidRequestError`` names it)."""
        if not len(names) == len(shapes) == len(dtypes):
            raise InvalidRequestError(f"names, shapes and dtypes differ in length ({len(names)}, {len(shapes)}, "
                                      f"{len(dtypes)})")
        check = self._weight_check()
        for name, shape, dtype in zip(names, shapes, dtypes):
            try:
                dt = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype)
                if not dt.is_floating_point:
                    raise ValueError(f"{dt} is not a floating-point dtype")
                check.check(name, tuple(shape))
            except (ValueError, ModelLoadError) as exc:
                raise InvalidRequestError(f"weight {name!r}: {exc}") from None

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES, weight_version: str | None = None) -> int:
        """Load new weights from ``(hf_name, full_tensor)`` pairs; returns how many tensors were applied.

        Names and shapes are checked before anything is sent. Runs at a step boundary; requests in
        flight continue with the new weights (as vLLM and SGLang do). ``weight_version`` names the
        new weights in outputs (default: the count of updates so far).
        """
        self._ensure_open()
        self._check_weights_resident()
        check = self._weight_check()
        applied = 0
        for bucket in _buckets(named_tensors, bucket_bytes, check):
            def send(bucket=bucket) -> int:
                self.coordinator.drain()
                return self.coordinator.pool.call("load_weights", tensors=bucket)[0]

            applied += self._loop.run(send)
            self.weights.updated_in_memory()
        self._new_weight_version(weight_version)
        return applied

    def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> None:
        """Reload every rank's shard from a checkpoint of the same architecture and shapes."""
        self._ensure_open()
        self._check_weights_resident()
        arch = load_model_arch(path)
        if arch.fingerprint() != self.arch.fingerprint():
            raise ModelLoadError(f"{path!r} is a different model (architecture or shapes differ from the served one)")
        safetensors_files(path)

        def reload() -> None:
            self.coordinator.drain()
            self.coordinator.pool.call("reload_weights", path=str(path))

        self._loop.run(reload)
        self.weights.updated_from_disk(str(path))
        self._new_weight_version(weight_version)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None,
                                  timeout_s: float | None = None) -> None:
        """Every worker joins a trainer's group (trainer = rank 0, worker r = ``rank_offset + r``).

        Blocks until the trainer has joined too. ``backend`` defaults to gloo on CPU, NCCL on GPU.
        """
        self._ensure_open()
        backend = backend or ("nccl" if self.config.device == "cuda" else "gloo")
        if backend not in BACKENDS:
            raise InvalidRequestError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if rank_offset < 1 or rank_offset + self.config.world > world_size:
            raise InvalidRequestError(f"ranks {rank_offset}..{rank_offset + self.config.world - 1} of this engine's "
                                      f"{self.config.world} workers do not fit a group of {world_size} (rank 0 is the trainer)")
        timeout = timeout_s or self.config.collective_timeout_s
        self._loop.run(lambda: self.coordinator.pool.call(
            "init_weights_update_group", master_address=master_address, master_port=int(master_port),
            rank_offset=rank_offset, world_size=world_size, group_name=group_name, backend=backend,
            timeout_s=timeout, timeout=timeout + 30))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", weight_version: str | None = None,
                                        timeout_s: float | None = None) -> int:
        """Receive full tensors the trainer broadcasts (in ``names`` order) and load them under the current
        layout. The update is checked whole first; a refused one leaves the weights as they were."""
        self._ensure_open()
        self._check_weights_resident()
        self.check_weight_update(names, [tuple(s) for s in shapes], dtypes)

        def receive() -> int:
            self.coordinator.drain()
            return self.coordinator.pool.call("update_weights_from_distributed", names=list(names),
                                              dtypes=[str(d) for d in dtypes], shapes=[list(s) for s in shapes],
                                              group_name=group_name, timeout=timeout_s)[0]

        applied = self._loop.run(receive)
        self.weights.updated_in_memory()
        self._new_weight_version(weight_version)
        return applied

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> bool:
        self._ensure_open()
        return all(self._loop.run(lambda: self.coordinator.pool.call("destroy_weights_update_group",
                                                                     group_name=group_name)))

    def _check_weights_resident(self) -> None:
        """Weights are written in place: refuse while ``sleep`` has them released (wake_up first)."""
        state = self.coordinator.sleep.weights
        if state is not None:
            raise InvalidRequestError(f"the weights are released ({state}); call wake_up(['weights']) before "
                                      "updating them")

    @property
    def weight_version(self) -> str:
        return self.weights.version

    def _new_weight_version(self, version: str | None) -> str:
        """Count one finished update; unfinished requests note from which token the new weights apply.
        The prefix cache is dropped: its blocks hold KV the old weights computed."""
        def mark() -> str:
            self.coordinator.flush_prefix_cache()
            name = self.weights.new_version(version)
            for seq in self.coordinator.unfinished():
                seq.weight_versions.append((len(seq.output_ids), name))
            return name

        return self._loop.run(mark)

    def sleep(self, level: int = 1, tags: list[str] | None = None) -> int:
        """Release memory for a colocated trainer; returns the bytes freed (summed over ranks).

        level 1: the KV cache (on GPU the weights also move to host memory);
        level 2: the KV cache and the weights (``wake_up`` reloads them from disk, or call
        ``update_weights`` after waking). ``tags`` (SGLang's ``kv_cache``, ``weights``,
        ``cuda_graph``) release exactly those instead; released weights are discarded.
        Runs at a step boundary: running requests give their KV back and are prefilled again after
        the wake-up (same tokens); nothing runs while any memory is released. Releasing what is
        already released is a no-op.
        """
        self._ensure_open()
        if tags is None:
            wanted, weights_to = tags_for_level(level, self.config.device == "cuda")
        else:
            wanted, weights_to = check_tags(tags), DISCARDED
        return self._loop.run(self.coordinator.release_memory, wanted, weights_to or DISCARDED)

    def wake_up(self, tags: list[str] | None = None) -> list[str]:
        """Restore what ``sleep`` released (``tags``: only "weights", "kv_cache" or "cuda_graph");
        returns what was restored. Whatever was not released is left alone: waking an awake engine
        is a no-op and never touches running requests or the prefix cache."""
        self._ensure_open()
        wanted = check_tags(tags)
        return sorted(self._loop.run(self.coordinator.restore_memory, wanted))

    @property
    def sleeping(self) -> bool:
        """Whether any memory is released (``sleep`` without the matching ``wake_up``)."""
        return self.coordinator.sleep.asleep

    def released_memory(self) -> list[str]:
        """The memory tags released now."""
        return sorted(self.coordinator.sleep.released())

    def pause(self, mode: str = "in_place") -> int:
        """Stop starting new steps until ``resume``; returns how many requests the mode touched.

        ``in_place``: requests keep their KV and continue where they were. ``retract``: every
        running request frees its KV and waits to be prefilled again (same tokens: sampling depends
        only on (seed, position)). ``abort``: every unfinished request finishes with reason "abort",
        keeping what it generated. Requests submitted while paused wait.
        """
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")

        def go() -> int:
            coord = self.coordinator
            coord.paused = True
            coord.drain()
            if mode == "retract":
                return coord.retract_all()
            if mode == "abort":
                return len(coord.abort([s.seq_id for s in coord.unfinished()], "abort", "aborted by pause (mode abort)"))
            return len(coord.unfinished())

        return self._loop.run(go)

    def resume(self) -> None:
        self._loop.run(lambda: setattr(self.coordinator, "paused", False))

    @property
    def paused(self) -> bool:
        return self.coordinator.paused

    def flush_cache(self) -> bool:
        """Drop the prefix cache (cached blocks are freed; blocks in use are no longer found by later
        requests), as vLLM's ``reset_prefix_cache`` and SGLang's ``flush_cache``."""
        self._loop.run(self.coordinator.flush_prefix_cache)
        return True

    def num_unfinished_requests(self) -> int:
        return self._loop.run(lambda: len(self.coordinator.unfinished()))
