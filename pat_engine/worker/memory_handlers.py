"""Control calls about device memory: release and restore for a colocated trainer, and on a GPU the
KV budget (from the rank's memory share, worker/device_memory.py) and the first KV pool (sized once the
driver knows what every rank can hold)."""

from __future__ import annotations

import torch

from pat_engine.config import EngineConfig
from pat_engine.parallel import ipc_collectives
from pat_engine.protocol.calls import AllocateKV, KVBudget, ReleaseMemory, RestoreMemory
from pat_engine.worker.device_memory import RankMemory
from pat_engine.worker.infer_executor import InferExecutor


class MemoryHandlers:
    def __init__(self, config: EngineConfig, executor: InferExecutor, share: RankMemory | None):
        self.config, self.executor = config, executor
        self.share = share  # None on the CPU

    def release_memory(self, call: ReleaseMemory) -> int:
        return self.executor.release_memory(call.kv, call.weights)

    def restore_memory(self, call: RestoreMemory) -> None:
        self.executor.restore_memory(call.kv_blocks, call.weights)

    def allocate_kv(self, call: AllocateKV) -> None:
        self.executor.allocate_kv(call.num_blocks)
        self.executor.capture_graphs()

    def kv_budget(self, call: KVBudget) -> int:
        if self.share is None:
            raise RuntimeError("KVBudget measures a GPU rank's memory share; this rank runs on the CPU")
        ex, cfg = self.executor, self.config
        arch, tp = ex.arch, ex.tp.size
        elt = torch.empty((), dtype=ex.dtype).element_size()
        # activations of the largest prefill step, plus full-vocab logits of a decode batch (float32)
        reserve = cfg.max_num_batched_tokens * (4 * arch.hidden_size + 2 * arch.activation_width // tp) * elt
        reserve += cfg.max_num_seqs * arch.vocab_size * 4
        # the decode graphs of every layout this world can take: a switch sets a layout's aside for a return
        reserve += sum(ex.graphs.reserve_bytes(arch.hidden_size, arch.activation_width // layout.tp, elt)
                       for layout in arch.valid_layouts(cfg.world))
        if self.share.sharing > 1 and ipc_collectives.colocated_path() == ipc_collectives.IPC:
            reserve += ipc_collectives.reserve_bytes(cfg.world)  # the slots of the groups later switches build
        return self.share.kv_budget(reserve)
