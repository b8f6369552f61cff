"""Where Ray puts the per-node engines: one actor pinned to each node by node id.

Nodes are told apart by id, not IP: a local test cluster runs every node on
one address.
"""

from __future__ import annotations

from typing import Any

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
