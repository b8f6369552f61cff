"""Register pat-engine with veRL as the rollout backend ``pat``.

Importing this module registers it: veRL imports it in every process when it
is named by the ``verl.plugins`` entry point, by ``VERL_USE_EXTERNAL_MODULES``
or by ``actor_rollout_ref.model.external_lib``. Two registries are filled:
``RolloutReplicaRegistry`` (driver side: replica and server) and
``_ROLLOUT_REGISTRY`` (trainer side: the ``BaseRollout`` adapter; veRL has no
register function for it, so the entry is added to its dict).
"""

from __future__ import annotations

NAME = "pat"
ADAPTER = "pat_integrations.verl.adapter.PatServerAdapter"


def _load_replica():
    from pat_integrations.verl.replica import PatReplica

    return PatReplica


def register() -> None:
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(NAME, _load_replica)
    base._ROLLOUT_REGISTRY[(NAME, "async")] = ADAPTER


register()
