"""A stand-in for veRL's hybrid trainer worker (``ActorRolloutRefWorker``), runnable on CPU.

veRL's real worker needs an FSDP or Megatron engine on GPUs. This class holds
only what ``ActorRolloutRefWorker.update_weights`` reads (``config``,
``rollout``, ``actor.engine``, LoRA flags) and then runs that very method, so
a weight update goes through veRL's own code: resume(weights) -> the rollout
adapter's update_weights over the trainer's full-tensor generator ->
barrier -> resume(kv_cache). The rollout adapter is built the way veRL's
``init_model`` builds it, through ``get_rollout_class``.

Two hooks of veRL assume an accelerator (device synchronise, GPU memory
logging); on CPU they are replaced by no-ops in veRL's worker module.
Wrapped with ``ray.remote`` by the test (a plain class pickles by reference).
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file


class StateDictEngine:
    """What veRL's model engine offers the weight sync: a generator of full HF-named tensors."""

    is_param_offload_enabled = False

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def get_per_tensor_param(self, layered_summon: bool = False, base_sync_done: bool = True):
        return ((name, t.clone()) for name, t in self.weights.items()), None


class HybridWorkerStandIn:
    def __init__(self, rank: int, world: int, port: int, actor_rollout_ref_cfg: Any):
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), RAY_LOCAL_WORLD_SIZE=str(world))
        import pat_integrations.verl.plugin  # noqa: F401  (as veRL's plugin loading would)
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig
        from verl.workers.rollout.base import get_rollout_class

        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=world)
        self.config = actor_rollout_ref_cfg
        rollout_cfg = omega_conf_to_dataclass(actor_rollout_ref_cfg.rollout)
        model_cfg = omega_conf_to_dataclass(actor_rollout_ref_cfg.model, HFModelConfig)
        self.rollout = get_rollout_class(rollout_cfg.name, rollout_cfg.mode)(
            config=rollout_cfg, model_config=model_cfg, device_mesh=None)
        self.actor = SimpleNamespace(engine=StateDictEngine())
        self.peft_merge = False
        self.layered_summon = False
        self.base_sync_done = True

    def rollout_class(self) -> str:
        return type(self.rollout).__qualname__

    def set_weights(self, safetensors_file: str) -> None:
        """What the optimiser step would leave in the trainer's parameters."""
        self.actor.engine.weights = load_file(safetensors_file)

    async def release_rollout(self) -> None:
        await self.rollout.release()

    async def resume_rollout(self, tags: list[str]) -> None:
        await self.rollout.resume(tags=tags)

    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> None:
        from verl.workers import engine_workers

        engine_workers.get_torch_device = lambda: SimpleNamespace(synchronize=lambda: None, empty_cache=lambda: None)
        engine_workers.log_gpu_memory_usage = lambda *args, **kwargs: None
        await engine_workers.ActorRolloutRefWorker.update_weights(self, global_steps=global_steps, mode=mode)
