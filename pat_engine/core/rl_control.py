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
from pat_engine.errors import InvalidRequestError, ModelLoadError
from pat_engine.model.arch import load_model_arch
from pat_engine.model.llama import CausalLM
from pat_engine.model.weights import WeightNameCheck, safetensors_files

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 << 20


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

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        """Load new weights from ``(hf_name, full_tensor)`` pairs; returns how many tensors were applied.

        Names and shapes are checked before anything is sent. Runs at a step boundary; requests in
        flight continue with the new weights (as vLLM and SGLang do).
        """
        self._ensure_open()
        check = self._weight_check()
        applied = 0
        for bucket in _buckets(named_tensors, bucket_bytes, check):
            def send(bucket=bucket) -> int:
                self.coordinator.drain()
                return self.coordinator.pool.call("load_weights", tensors=bucket)[0]

            applied += self._loop.run(send)
            self.weights.updated_in_memory()
        return applied

    def update_weights_from_disk(self, path: str) -> None:
        """Reload every rank's shard from a checkpoint of the same architecture and shapes."""
        self._ensure_open()
        arch = load_model_arch(path)
        if arch.fingerprint() != self.arch.fingerprint():
            raise ModelLoadError(f"{path!r} is a different model (architecture or shapes differ from the served one)")
        safetensors_files(path)

        def reload() -> None:
            self.coordinator.drain()
            self.coordinator.pool.call("reload_weights", path=str(path))

        self._loop.run(reload)
        self.weights.updated_from_disk(str(path))

    def sleep(self, level: int = 1) -> int:
        """Release memory for a colocated trainer; returns the bytes freed (summed over ranks).

        level 1: the KV cache (on GPU the weights also move to host memory);
        level 2: the KV cache and the weights (``wake_up`` reloads them from disk, or call
        ``update_weights`` after waking).
        """
        self._ensure_open()
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level!r}")

        def go() -> int:
            busy = len(self.coordinator.unfinished())
            if busy:
                raise InvalidRequestError(f"cannot sleep with {busy} unfinished requests; abort or wait for them")
            return sum(self.coordinator.pool.call("sleep", level=level))

        freed = self._loop.run(go)
        self.weights.slept(level)
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released; ``tags`` may restrict it to "weights" and/or "kv_cache"."""
        self._ensure_open()
        tags = list(tags) if tags is not None else ["weights", "kv_cache"]
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise InvalidRequestError(f"unknown wake_up tags {sorted(unknown)}; use 'weights' and/or 'kv_cache'")
        weights = "weights" in tags
        blocks = self.memory.num_blocks(self.coordinator.layout) if "kv_cache" in tags else None

        def go() -> None:
            self.coordinator.pool.call("wake_up", kv_blocks=blocks, weights=weights)
            if self.weights.woke(weights, kv_cache=blocks is not None):
                self.coordinator.pool.call("reload_weights", path=self.weights.path)

        self._loop.run(go)

    @property
    def sleeping(self) -> bool:
        return self.weights.sleep_level > 0

    def pause(self) -> None:
        """Stop starting new steps (requests keep their KV); ``resume`` continues them."""
        self._loop.run(lambda: setattr(self.coordinator, "paused", True))

    def resume(self) -> None:
        self._loop.run(lambda: setattr(self.coordinator, "paused", False))

    def flush_cache(self) -> bool:
        """API compatibility with vLLM/SGLang: pat-engine keeps no prefix cache, so there is nothing to drop."""
        return True

    def num_unfinished_requests(self) -> int:
        return self._loop.run(lambda: len(self.coordinator.unfinished()))
