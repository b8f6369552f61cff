"""Adapters that let RL frameworks use pat-engine as their rollout engine.

Each subpackage imports its framework only when it is imported itself, so
``import pat_integrations`` works with none of them installed:

- ``pat_integrations.verl``: a veRL 0.9.x rollout replica, server actor and
  trainer-side adapter, registered under the rollout name ``pat``;
- ``pat_integrations.openrlhf``: a Ray actor with the methods of OpenRLHF's
  ``RolloutRayActor`` and a ``create_pat_engines`` factory;
- ``pat_integrations.ray_cluster``: one engine per node as a Ray actor (TP
  inside a node, DP across nodes) behind a request-spreading coordinator.

The modules at this level (``stage``, ``sampling``, ``async_bridge``) are
framework-free helpers shared by the adapters.
"""

__all__ = ["stage", "sampling", "async_bridge"]
