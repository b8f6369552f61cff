"""Where Ray puts pat engines: one actor pinned to each node by node id; which GPUs a process holds.

Nodes are told apart by id, not IP: a local test cluster runs every node on
one address. A pat engine's worker processes are children of the process that builds
the ``Engine`` and inherit its environment: worker rank ``r`` uses the ``r``-th device
``CUDA_VISIBLE_DEVICES`` names (``pat_engine.worker``), so ``expose_gpus`` is how an adapter
puts each rank on the GPU it was given (veRL's hybrid workers, OpenRLHF's shared bundles).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def alive_node_ids() -> list[str]:
    """Ids of the alive nodes, head first then in Ray's order (stable within a cluster's life)."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    head = [n for n in nodes if n.get("Resources", {}).get("node:__internal_head__")]
    rest = [n for n in nodes if n not in head]
    return [n["NodeID"] for n in head + rest]


def pinned_to(node_id: str, **options: Any) -> dict[str, Any]:
    """Actor options that place it on ``node_id`` and nowhere else."""
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False), **options}


def here() -> tuple[str, list[str]]:
    """The calling process's node id and the GPU ids Ray assigned to it (empty without GPUs)."""
    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), [str(i) for i in ctx.get_accelerator_ids().get("GPU", [])]


def expose_gpus(gpu_ids: Sequence[str]) -> None:
    """Give the engine built next in this process the GPUs ``gpu_ids``, rank ``r`` the ``r``-th
    (call before building it; nothing is changed for an empty list: CPU engines)."""
    if gpu_ids:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
