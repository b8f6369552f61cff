"""Control calls of RL weight sync: full named tensors (by value, by handle, by a trainer's broadcast)
or a checkpoint on disk, each rank keeping its own shards under the current layout."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pat_engine.protocol.calls import (
    DestroyWeightsUpdateGroup, InitWeightsUpdateGroup, LoadWeights, LoadWeightsFromHandles, ReloadWeights,
    UpdateWeightsFromDistributed,
)
from pat_engine.worker.infer_executor import InferExecutor


class WeightHandlers:
    def __init__(self, rank: int, executor: InferExecutor):
        self.rank, self.executor = rank, executor
        self.update_groups: dict[str, object] = {}  # trainer weight-update groups, by name

    def load_weights(self, call: LoadWeights) -> int:
        return self.executor.load_tensors(call.tensors)

    def load_weights_from_handles(self, call: LoadWeightsFromHandles) -> int:
        from pat_engine.model.weight_handles import load_named_tensors
        from pat_engine.model.weights import WeightNameCheck

        device = self.executor.device
        tensors = load_named_tensors(call.payloads, self.rank, device)  # views of the trainer's memory
        check = WeightNameCheck(self.executor.model)
        for name, tensor in tensors:  # the whole bucket before any of it is applied
            check.check(name, tuple(tensor.shape))
        applied = self.executor.load_tensors(tensors)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the trainer may free or overwrite its tensors once we answer
        return applied

    def reload_weights(self, call: ReloadWeights) -> None:
        self.executor.load_weights(call.path)

    def init_weights_update_group(self, call: InitWeightsUpdateGroup) -> None:
        from pat_engine.parallel.update_group import STATELESS_NCCL, join_stateless_nccl, join_update_group

        if call.group_name in self.update_groups:
            raise ValueError(f"weight-update group {call.group_name!r} already exists; destroy it first")
        rank = call.rank_offset + self.rank
        if call.backend == STATELESS_NCCL:  # each worker receives on its own device
            group = join_stateless_nccl(call.master_address, call.master_port, rank, call.world_size,
                                        self.executor.device)
        else:
            group = join_update_group(call.master_address, call.master_port, rank, call.world_size, call.group_name,
                                      call.backend, call.timeout_s)
        self.update_groups[call.group_name] = group

    def update_weights_from_distributed(self, call: UpdateWeightsFromDistributed) -> int:
        from pat_engine.parallel.update_group import receive_broadcast

        tensors = receive_broadcast(self.update_groups[call.group_name], call.names, call.dtypes, call.shapes,
                                    self.executor.device)
        return self.executor.load_tensors(tensors)

    def destroy_weights_update_group(self, call: DestroyWeightsUpdateGroup) -> bool:
        pg = self.update_groups.pop(call.group_name, None)
        if isinstance(pg, dist.ProcessGroup):
            dist.destroy_process_group(pg)
        return pg is not None  # a PyNccl communicator is dropped with its last reference
