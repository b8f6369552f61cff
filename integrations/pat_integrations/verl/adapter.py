"""``PatServerAdapter``: veRL's trainer-side rollout handle (a ``BaseRollout``) for pat-engine.

Every trainer rank builds one (``get_rollout_class("pat")``); the first rank
of each replica talks to the replica's server, found by actor name. Weights
arrive as veRL's generator of full Hugging Face-named tensors; every rank
drains it (the generator may run collectives), and the talking rank ships
buckets of ``checkpoint_engine.update_weights_bucket_megabytes`` to the server
through Ray's object store, one bucket in flight, so the model is never held
twice. The server applies each bucket with ``Engine.update_weights`` under its
current layout.
"""

from __future__ import annotations

import logging
import os
from typing import Any, AsyncIterator, Iterable

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from pat_integrations.verl.replica import server_name

log = logging.getLogger(__name__)


async def _aiter(items: Any) -> AsyncIterator:
    if hasattr(items, "__aiter__"):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


def _trainer_rank() -> int:
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


class PatServerAdapter(BaseRollout):
    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None, replica_rank: int = -1, **_: Any):
        super().__init__(config, model_config, device_mesh)
        c = self.config
        world = c.tensor_model_parallel_size * c.data_parallel_size * c.pipeline_model_parallel_size
        rank = _trainer_rank()
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self.bucket_bytes = int(c.checkpoint_engine.update_weights_bucket_megabytes) << 20
        self._server = None

    @property
    def has_server(self) -> bool:
        return self.rollout_rank == 0

    def server(self):
        if self._server is None:  # the server starts after the trainer workers, so look it up lazily
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        if self.config.free_cache_engine and self.has_server:
            await self.server().wake_up.remote(tags=tags)

    async def release(self) -> None:
        if self.config.free_cache_engine and self.has_server:
            await self.server().sleep.remote()

    async def update_weights(self, weights: Iterable, wire_format: str = "named_tensors",
                             global_steps: int | None = None, peft_config: Any = None, **kwargs: Any) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"pat-engine takes full named tensors, not wire_format={wire_format!r}")
        if peft_config is not None:
            raise NotImplementedError("pat-engine has no LoRA adapters; set actor_rollout_ref.model.lora.merge=True")
        bucket: list[tuple[str, torch.Tensor]] = []
        size = sent = 0
        async for name, tensor in _aiter(weights):
            if not self.has_server:
                continue  # drained all the same: producing a tensor may be collective across ranks
            tensor = tensor.detach().to("cpu").contiguous()
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                sent += await self.server().update_weights_bucket.remote(bucket)
                bucket, size = [], 0
        if not self.has_server:
            return
        if bucket:
            sent += await self.server().update_weights_bucket.remote(bucket)
        await self.server().finish_weight_update.remote(global_steps)
        log.info("pat rollout: %d tensors sent to %s", sent, server_name(self.replica_rank))
