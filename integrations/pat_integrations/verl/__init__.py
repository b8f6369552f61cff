"""pat-engine as a veRL 0.9.x rollout backend, named ``pat``.

- ``plugin``: registers the backend (import it, or let veRL import it; see docs/integrations.md);
- ``replica.PatReplica``: the ``RolloutReplica`` veRL builds per replica;
- ``server.PatServer``: the server actor body (one pat-engine);
- ``adapter.PatServerAdapter``: the trainer-side ``BaseRollout`` (weight sync, sleep/wake);
- ``settings.PatRolloutSettings``: veRL rollout config -> engine options.

Importing a module of this package imports veRL and Ray.
"""
