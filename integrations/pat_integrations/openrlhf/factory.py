"""``create_pat_engines``: OpenRLHF's ``create_vllm_engines``, same arguments, pat-engine actors.

Swap it in where OpenRLHF calls ``create_vllm_engines`` (``openrlhf/cli/train_ppo_ray.py``);
the returned handles take every call OpenRLHF's driver makes on its engines.
Extra keyword arguments (``pat_base_tp``, ``pat_switch_schedule``,
``pat_engine_kwargs``, ``pat_rollout``, ``num_cpus_per_engine``) set what vLLM has no name for.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pat_integrations.openrlhf.actor import PatRolloutActor
from pat_integrations.openrlhf.colocate import engine_bundles

log = logging.getLogger(__name__)


def create_pat_engines(
    num_engines: int,
    tensor_parallel_size: int,
    pretrain: str,
    seed: int,
    full_determinism: bool,
    enable_prefix_caching: bool,
    enforce_eager: bool,
    max_model_len: int,
    shared_pg: Any = None,
    gpu_memory_utilization: Optional[float] = None,
    vllm_enable_sleep: bool = False,
    logprobs_mode: Optional[str] = None,
    agent_func_path: Optional[str] = None,
    remote_rm_url: Optional[str] = None,
    max_images_per_prompt: int = 0,
    *,
    pat_base_tp: Optional[int] = None,
    pat_switch_schedule: Optional[list[tuple[int, int]]] = None,
    pat_engine_kwargs: Optional[dict[str, Any]] = None,
    pat_rollout: Optional[dict[str, Any]] = None,
    num_cpus_per_engine: float = 0,
) -> list:
    """One pat-engine of ``tensor_parallel_size`` devices per OpenRLHF engine; returns Ray actor handles.

    ``shared_pg`` (OpenRLHF's hybrid engine): engine ``i`` takes the bundles OpenRLHF's
    ``get_bundle_indices`` gives it, one rank per bundle on one node (``openrlhf.colocate``); its actor
    sits on the first of them and holds no GPU itself. Otherwise each actor holds its engine's GPUs.
    """
    if max_images_per_prompt:
        raise ValueError("pat-engine serves text-only models (max_images_per_prompt > 0)")
    placed: list[list[int] | None] = [None] * num_engines
    if shared_pg is not None:  # every engine's bundles checked before any actor starts
        table = ray.util.placement_group_table(shared_pg)["bundles_to_node_id"]
        placed = [engine_bundles(table, i, tensor_parallel_size) for i in range(num_engines)]
    # a pat engine's worker processes are children of the actor: alone, the actor holds all the engine's GPUs
    gpus = ray.cluster_resources().get("GPU", 0)
    num_gpus = tensor_parallel_size if gpus and shared_pg is None else 0
    remote_cls = ray.remote(PatRolloutActor)
    engines = []
    for i, bundles in enumerate(placed):
        where = {} if bundles is None else {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            shared_pg, placement_group_bundle_index=bundles[0], placement_group_capture_child_tasks=True)}
        kwargs: dict[str, Any] = {
            "model": pretrain,
            "tensor_parallel_size": tensor_parallel_size,
            "seed": seed + i,
            "max_model_len": max_model_len,
            "enable_prefix_caching": enable_prefix_caching,
            "enforce_eager": enforce_eager,
            "dtype": "bfloat16",  # what OpenRLHF asks of vLLM; pat_engine_kwargs may override it
            "full_determinism": full_determinism,
            "gpu_memory_utilization": gpu_memory_utilization,
            "logprobs_mode": logprobs_mode,
            "pat_base_tp": pat_base_tp,
            "pat_switch_schedule": pat_switch_schedule,
            "pat_engine_kwargs": pat_engine_kwargs,
            "pat_rollout": pat_rollout,
        }
        engines.append(remote_cls.options(num_cpus=num_cpus_per_engine, num_gpus=num_gpus, **where).remote(
            bundle_indices=bundles, agent_func_path=agent_func_path, remote_rm_url=remote_rm_url, **kwargs))
    if vllm_enable_sleep:
        ray.get([e.sleep.remote() for e in engines])
    return engines
