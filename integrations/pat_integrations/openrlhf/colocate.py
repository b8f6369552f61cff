"""OpenRLHF's hybrid engine (``--train.colocate_all``, formerly ``--colocate_all_models``): pat ranks on
the trainer's bundles.

OpenRLHF's contract (0.11.2, read from its source): ``train_ppo_ray.py`` builds one placement group
with a bundle ``{"GPU": 1, "CPU": 1}`` per trainer GPU (``PACK``) and ``RayActorGroup`` puts trainer
rank ``r`` on bundle ``r`` with 0.2 GPU. ``create_vllm_engines(shared_pg=pg)`` gives engine ``i`` the
bundles ``get_bundle_indices(pg, i, tp)`` (``trainer/ray/utils.py``): the group's bundles listed node
by node, sliced ``tp`` at a time; the engine actor sits on the first one and its vLLM workers take
0.2 GPU of each (``VLLM_RAY_BUNDLE_INDICES``, ``VLLM_RAY_PER_WORKER_GPUS``). Weights then come by
``update_weight_cuda_ipc``: one handle per trainer GPU, keyed by the GPU's UUID, which each rollout
worker picks for its own GPU.

A pat engine's worker processes are children of its actor, so a rank is placed by the environment it
inherits. The actor seats one ``RankSeat`` (a tiny actor) on each of its bundles with OpenRLHF's share
of that bundle: the Ray resources the rank occupies, and how the actor learns which GPU the bundle
holds. It then names those GPUs in ``CUDA_VISIBLE_DEVICES`` in rank order
(``ray_cluster.placement.expose_gpus``): worker rank ``r`` runs on the GPU of bundle
``bundle_indices[r]``, the GPU trainer rank ``bundle_indices[r]`` shares, so its IPC handle is the one
keyed by its own GPU. TP stays inside a node: an engine whose bundles span nodes is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pat_integrations.ray_cluster.placement import expose_gpus, here

SHARE = 0.2  # OpenRLHF's share of a device for each process colocated on it (trainer ranks, vLLM workers)
SEAT_TIMEOUT_S = 300.0


def node_ordered(bundles_to_node: Mapping[int, str]) -> list[int]:
    """The bundle indices listed node by node (nodes in order of their first bundle), as
    ``get_bundle_indices`` lists them, so that an engine's slice lies on one node where it can."""
    by_node: dict[str, list[int]] = {}
    for bundle in sorted(bundles_to_node):
        by_node.setdefault(bundles_to_node[bundle], []).append(bundle)
    return [b for bundles in by_node.values() for b in bundles]


def engine_bundles(bundles_to_node: Mapping[int, str], engine: int, size: int) -> list[int]:
    """The ``size`` bundles of engine ``engine``: one per rank, all on one node."""
    ordered = node_ordered(bundles_to_node)
    chosen = ordered[engine * size:(engine + 1) * size]
    if len(chosen) < size:
        raise ValueError(f"engine {engine} needs bundles {engine * size}..{(engine + 1) * size - 1} of the shared "
                         f"placement group, which has {len(ordered)}: num_engines * tensor_parallel_size must not "
                         "exceed the trainer's GPUs")
    nodes = {bundles_to_node[b] for b in chosen}
    if len(nodes) > 1:
        raise ValueError(f"engine {engine}'s bundles {chosen} span {len(nodes)} nodes; a pat engine keeps TP inside "
                         "a node: choose a tensor_parallel_size that divides the GPUs of each node")
    return chosen


def seat_options(bundle: Mapping[str, float]) -> dict[str, float]:
    """The Ray resources one rank takes of its bundle: OpenRLHF's share of its GPU, or of its CPU where
    the bundle has no GPU (CPU clusters, tests)."""
    return {"num_cpus": 0, "num_gpus": SHARE} if bundle.get("GPU") else {"num_cpus": SHARE}


class RankSeat:
    """Held for the engine's life on one rank's bundle; says where it runs (``placement.here``)."""

    def where(self) -> tuple[str, list[str]]:
        return here()


@dataclass
class Seats:
    """Where an engine's ranks sit: rank ``r`` on ``bundles[r]``, GPU ``gpu_ids[r]`` (none on CPU)."""

    bundles: list[int]
    node_id: str
    gpu_ids: list[str]
    actors: list[Any]

    def release(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def take_seats(pg: Any, bundles: list[int], timeout_s: float = SEAT_TIMEOUT_S) -> Seats:
    """One ``RankSeat`` per bundle of ``pg``, in rank order; refused unless all sit on one node and either
    every bundle or none holds a GPU."""
    remote = ray.remote(RankSeat)
    actors = [remote.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
                             **seat_options(pg.bundle_specs[b])).remote() for b in bundles]
    seats = Seats(list(bundles), "", [], actors)
    try:
        places = ray.get([a.where.remote() for a in actors], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        seats.release()
        raise RuntimeError(f"could not seat a rank on each of the bundles {bundles} within {timeout_s:.0f}s: each "
                           f"needs {seat_options(pg.bundle_specs[bundles[0]])} left in its bundle") from None
    nodes = {node for node, _ in places}
    gpus = [ids[0] for _, ids in places if ids]
    if len(nodes) != 1 or len(gpus) not in (0, len(bundles)):
        seats.release()
        raise RuntimeError(f"the bundles {bundles} give {len(nodes)} nodes and {len(gpus)} GPUs; a pat engine needs "
                           "one node and one GPU per rank (or none)")
    seats.node_id, seats.gpu_ids = nodes.pop(), gpus
    return seats


def seat_engine(bundle_indices: list[int], world: int) -> Seats:
    """In the engine actor, before it builds its engine: seat its ``world`` ranks on ``bundle_indices``
    of the placement group the actor runs in, and give the engine those bundles' GPUs."""
    pg = ray.util.get_current_placement_group()
    if pg is None:
        raise ValueError("bundle_indices were given, but this actor runs outside a placement group (create it with "
                         "create_pat_engines(shared_pg=...), or with placement_group_capture_child_tasks=True)")
    if len(bundle_indices) != world:
        raise ValueError(f"{len(bundle_indices)} bundle_indices for an engine of {world} devices: one bundle per rank")
    seats = take_seats(pg, [int(b) for b in bundle_indices])
    if here()[0] != seats.node_id:  # the ranks are this actor's child processes
        seats.release()
        raise RuntimeError(f"the engine actor runs on another node than its bundles {list(bundle_indices)}")
    expose_gpus(seats.gpu_ids)
    return seats
