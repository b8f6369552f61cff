"""``WorkerClient``: one typed method per control call the driver makes on its workers.

Each method builds the call's dataclass (``pat_engine.protocol.calls``) and sends
it through the pool, which waits for every addressed rank; the values come back in
rank order. Runs in the engine loop thread, like everything that talks to workers.
"""

from __future__ import annotations

from typing import Any, Protocol

from pat_engine.protocol import (
    AllocateKV, BandwidthProbe, DestroyWeightsUpdateGroup, InitWeightsUpdateGroup, InjectFault, KVBudget,
    LoadWeights, LoadWeightsFromHandles, ReleaseMemory, ReloadWeights, RestoreMemory, Stats, Switch, SwitchPlan,
    SwitchReport, UpdateWeightsFromDistributed, WorkerCall,
)


class CallTransport(Protocol):
    """What the client needs of a pool (``WorkerPool``, or the in-process fake the tests use)."""

    def call(self, body: WorkerCall, ranks: list[int] | None = None, timeout: float | None = None) -> list:
        """Args: the call, the ranks (None: all), seconds to wait. Returns: each rank's value, by rank."""
        ...


class WorkerClient:
    def __init__(self, transport: CallTransport) -> None:
        self._pool = transport

    # ---- layout and diagnostics ----------------------------------------------------------------

    def switch(self, plan: SwitchPlan) -> SwitchReport:
        """Run a live layout change on every rank; the ranks' reports merged."""
        return SwitchReport.merge(self._pool.call(Switch(plan)))

    def stats(self) -> list[dict]:
        return self._pool.call(Stats())

    def bandwidth_probe(self, nbytes: int, repeats: int = 3) -> list[float]:
        return self._pool.call(BandwidthProbe(nbytes, repeats))

    def inject_fault(self, where: str, how: str = "raise", ranks: list[int] | None = None) -> None:
        self._pool.call(InjectFault(where, how), ranks)

    # ---- weights ---------------------------------------------------------------------------------

    def load_weights(self, tensors: list[tuple[str, Any]]) -> int:
        """Tensors applied (the count rank 0 reports; every rank applies the same names)."""
        return self._pool.call(LoadWeights(tensors))[0]

    def load_weights_from_handles(self, payloads: list[bytes]) -> int:
        """One bucket by handle; tensors applied (rank 0's count)."""
        return self._pool.call(LoadWeightsFromHandles(payloads))[0]

    def reload_weights(self, path: str) -> None:
        self._pool.call(ReloadWeights(path))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout_s: float) -> None:
        # the join waits for the trainer too: allow its own timeout plus the round trip
        self._pool.call(InitWeightsUpdateGroup(master_address, master_port, rank_offset, world_size, group_name,
                                               backend, timeout_s), timeout=timeout_s + 30)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, timeout_s: float | None = None) -> int:
        return self._pool.call(UpdateWeightsFromDistributed(names, dtypes, shapes, group_name), timeout=timeout_s)[0]

    def destroy_weights_update_group(self, group_name: str) -> bool:
        return all(self._pool.call(DestroyWeightsUpdateGroup(group_name)))

    # ---- memory ------------------------------------------------------------------------------------

    def kv_budget(self, utilization: float) -> list[int]:
        return self._pool.call(KVBudget(utilization))

    def allocate_kv(self, num_blocks: int) -> None:
        self._pool.call(AllocateKV(num_blocks))

    def release_memory(self, kv: bool, weights: str | None) -> int:
        """Bytes freed, summed over the ranks."""
        return sum(self._pool.call(ReleaseMemory(kv, weights)))

    def restore_memory(self, kv_blocks: int | None, weights: bool) -> None:
        self._pool.call(RestoreMemory(kv_blocks, weights))
