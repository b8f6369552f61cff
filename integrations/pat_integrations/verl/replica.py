"""``PatReplica``: veRL's handle on one pat-engine replica.

veRL builds replicas from ``actor_rollout_ref.rollout.name`` through its
``RolloutReplicaRegistry``; ``launch_servers`` is the one method a backend
must provide. A pat replica is one engine inside one node: its server actor is
pinned to the node of the trainer workers it shares devices with (hybrid
mode) and named ``pat_server_{replica}_0``, which is how the trainer-side
``PatServerAdapter`` finds it. The base class fans sleep, wake-up, abort and
resume out to the server.
"""

from __future__ import annotations

import asyncio

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.workers.rollout.replica import RolloutReplica

from pat_integrations.ray_cluster.placement import here
from pat_integrations.verl.server import PatServer

SERVER_PREFIX = "pat_server"


def server_name(replica_rank: int, node_rank: int = 0, suffix: str = "") -> str:
    return f"{SERVER_PREFIX}_{replica_rank}_{node_rank}{suffix}"


def _where(_worker) -> tuple[str, list[str]]:
    return here()  # run in each trainer worker (``__ray_call__``): its node and GPUs


class PatReplica(RolloutReplica):
    def rollout_worker_use_gpu(self) -> bool:
        import torch

        return torch.cuda.is_available()

    async def launch_servers(self) -> None:
        if self.nnodes != 1:
            raise ValueError(
                f"a pat replica runs inside one node, but this one spans {self.nnodes} nodes "
                f"({self.world_size} devices, {self.gpus_per_replica_node} per node); lower data_parallel_size "
                "so that veRL runs more, node-sized replicas")
        if not self.workers:
            raise RuntimeError("no workers to place the pat server next to (init_hybrid / init_colocated first)")
        places = await asyncio.gather(*[w.__ray_call__.remote(_where) for w in self.workers])
        node_ids = {node for node, _ in places}
        if len(node_ids) != 1:
            raise RuntimeError(f"the replica's workers sit on {len(node_ids)} nodes; a pat replica needs one")
        gpus = ",".join(g for _, ids in places for g in ids) or None
        role = "reward_" if self.is_reward_model else "teacher_" if self.is_teacher_model else ""
        name = f"{SERVER_PREFIX}_{role}{self.replica_rank}_0{self.name_suffix}"
        server = ray.remote(PatServer).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_ids.pop(), soft=False),
            name=name,
            max_concurrency=self.max_concurrency,
            num_cpus=0,
        ).remote(self.config, self.model_config, self.rollout_mode, self.replica_rank, self.gpus_per_replica_node, gpus)
        self.servers = [server]
        self._server_handle = server
        self._server_address = await server.get_server_address.remote()

    async def sleep(self) -> None:
        await self._server_handle.wait_for_requests_to_drain.remote()
        await super().sleep()
