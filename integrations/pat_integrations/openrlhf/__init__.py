"""pat-engine as OpenRLHF's rollout engine (OpenRLHF 0.11.x contract).

- ``factory.create_pat_engines``: drop-in for ``create_vllm_engines`` (same arguments);
- ``actor.PatRolloutActor``: the methods of ``RolloutRayActor``;
- ``weight_sync.stateless_gloo_group``: the trainer's side of the CPU weight-update group;
- ``colocate``: the hybrid engine's ranks on the bundles of OpenRLHF's shared placement group;
- ``outputs``: ``vllm.RequestOutput``-shaped results.

OpenRLHF itself is imported only for ``generate_responses`` without an agent file.
Importing a module of this package imports Ray.
"""
