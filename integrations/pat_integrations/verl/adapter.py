"""``PatServerAdapter``: veRL's trainer-side rollout handle (a ``BaseRollout``) for pat-engine.

Every trainer rank builds one (``get_rollout_class("pat")``); the first rank
of each replica talks to the replica's server, found by actor name. Weights
arrive as veRL's generator of full Hugging Face-named tensors; every rank
drains it (the generator may run collectives) in buckets of
``checkpoint_engine.update_weights_bucket_megabytes``, one bucket in flight, so
the model is never held twice.

How a bucket reaches the server (``engine_kwargs.pat.weight_transfer``):
- ``handles`` (hybrid mode: trainer and replica share the node and its
  devices): the bucket travels by handle, as veRL's own vLLM and SGLang
  adapters do it. With veRL's ``infer_tp`` mesh spanning the replica's devices,
  every trainer rank shares its copy (CUDA IPC on its GPU) and the talking rank
  gathers them, one per engine worker; worker ``r`` opens rank ``r``'s. Without
  that mesh, CPU tensors go from the talking rank alone (shared memory is
  node-wide, a GPU handle is not). The ranks wait for the server before they
  drop the bucket.
- ``object_store``: the talking rank ships tensor values through Ray.
- ``auto`` (default): handles where one of the two cases above holds.
The server applies each bucket under its current layout.
"""

from __future__ import annotations

import logging
import os
from typing import Any, AsyncIterator, Iterable

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from pat_engine.model.weight_handles import serialize_named_tensors
from pat_integrations.verl.replica import server_name
from pat_integrations.verl.settings import weight_transfer

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
        self.weight_transfer = weight_transfer(c)
        self.world = world
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
        path: str | None = None  # "handles" or "object_store", decided on the first tensor
        async for name, tensor in _aiter(weights):
            path = path or self._transfer_path(tensor)
            if not (self.has_server or (path == "handles" and self._handle_group() is not None)):
                continue  # drained all the same: producing a tensor may be collective across ranks
            if path == "object_store":
                tensor = tensor.detach().to("cpu").contiguous()
            bucket.append((name, tensor.detach()))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                sent += await self._send(path, bucket)
                bucket, size = [], 0
        if bucket:
            sent += await self._send(path, bucket)
        if not self.has_server:
            return
        await self.server().finish_weight_update.remote(global_steps)
        log.info("pat rollout: %d tensors sent to %s (%s)", sent, server_name(self.replica_rank), path)

    def _handle_group(self) -> Any:
        """veRL's ``infer_tp`` mesh when it spans this replica's devices (rank r shares worker r's), else None."""
        mesh = self.device_mesh
        if mesh is None or "infer_tp" not in (mesh.mesh_dim_names or ()) or mesh["infer_tp"].size() != self.world:
            return None
        return mesh["infer_tp"]

    def _transfer_path(self, tensor: torch.Tensor) -> str:
        if self.weight_transfer == "object_store":
            return "object_store"
        if self._handle_group() is not None or tensor.device.type == "cpu":
            return "handles"
        if self.weight_transfer == "handles":
            raise RuntimeError(f"weight_transfer='handles' with {tensor.device.type} tensors needs veRL's infer_tp "
                               f"mesh over the replica's {self.world} devices (a GPU handle opens only on its GPU)")
        return "object_store"

    async def _send(self, path: str, bucket: list[tuple[str, torch.Tensor]]) -> int:
        """One bucket to the server; returns the tensors it applied (0 on ranks that do not talk)."""
        if path == "object_store":
            return await self.server().update_weights_bucket.remote(bucket) if self.has_server else 0
        payload = serialize_named_tensors(bucket)
        mesh = self._handle_group()
        if mesh is None:  # CPU tensors: the talking rank's shared memory serves every worker
            return await self.server().update_weights_handles.remote([payload]) if self.has_server else 0
        group = mesh.get_group()
        gathered = [None] * mesh.size() if self.has_server else None
        torch.distributed.gather_object(payload, gathered, dst=torch.distributed.get_global_rank(group, 0), group=group)
        applied = await self.server().update_weights_handles.remote(gathered) if self.has_server else 0
        torch.distributed.barrier(group=group)  # every rank keeps its copy until the workers have taken it
        return applied
