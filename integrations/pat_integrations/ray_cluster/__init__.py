"""pat-engine across machines with Ray: one engine per node, TP inside a node, DP across nodes.

    import ray
    from pat_integrations.ray_cluster import RayClusterEngine
    ray.init(address="auto")
    cluster = RayClusterEngine("path/to/model", tp=1, dp=8)  # an 8-device engine on every node
    outs = cluster.generate(prompts, params, plans={1: StagePlan.from_options([(64, 8)])})

Importing this package imports Ray.
"""

from pat_integrations.ray_cluster.cluster import RayClusterEngine
from pat_integrations.ray_cluster.node_engine import NodeEngine
from pat_integrations.ray_cluster.placement import alive_node_ids, pinned_to

__all__ = ["RayClusterEngine", "NodeEngine", "alive_node_ids", "pinned_to"]
