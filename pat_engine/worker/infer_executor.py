"""InferExecutor: one rank's model shard, paged KV pool and batch forward.

The coordinator sends the same ``StepCommand`` to every rank of a DP group;
each rank runs its shard, TP rank 0 gathers the logits and samples. The
executor keeps each sequence's block table and sampling spec, so decode
messages stay small.
"""

from __future__ import annotations

import time
import torch
from torch.profiler import record_function

from pat_engine.model.arch import ModelArch
from pat_engine.model.llama import CausalLM, ForwardContext
from pat_engine.model.weights import load_shard_from_disk
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.layout import Layout
from pat_engine.protocol import StepCommand, StepResult
from pat_engine.sampling.sampler import sample_batch
from pat_engine.worker.kv_pool import PagedKVPool
from pat_engine.worker.step_inputs import SeqState, StepInputBuilder


class InferExecutor:
    def __init__(self, arch: ModelArch, layout: Layout, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 block_size: int, num_blocks: int):
        self.arch, self.layout, self.tp = arch, layout, tp
        self.dtype, self.device = dtype, device
        self.block_size = block_size
        self.model = CausalLM(arch, layout.tp, dtype, device)
        self.kv = self.new_pool(layout, num_blocks)
        self.seqs: dict[int, SeqState] = {}
        self.weights_state = "resident"  # or "offloaded" / "released" while the engine sleeps

    def new_pool(self, layout: Layout, num_blocks: int) -> PagedKVPool:
        return PagedKVPool(self.arch.num_layers, num_blocks, self.block_size, self.arch.kv_heads_per_rank(layout.tp),
                           self.arch.head_dim, self.dtype, self.device)

    def load_weights(self, model_path: str) -> None:
        load_shard_from_disk(self.model, model_path, self.tp.rank, self.tp.size)

    # ---- memory release for colocated training (sleep / wake_up) ----------------------------

    def release_memory(self, level: int) -> int:
        """Level 1: drop the KV pool (and on GPU move weights to host); level 2: drop weights too."""
        freed = self.kv.nbytes
        self.kv.release()
        self.kv = self.new_pool(self.layout, 0)
        if level >= 2 or self.device.type != "cpu":
            for p in self.model.parameters():
                freed += p.numel() * p.element_size()
                p.data = torch.empty(0, dtype=p.dtype) if level >= 2 else p.data.to("cpu")
            self.weights_state = "released" if level >= 2 else "offloaded"
        return freed

    def restore_weights(self) -> None:
        """Bring weights back after ``release_memory``: from host memory, or zeroed (to be reloaded)."""
        state = self.weights_state
        if state == "resident":
            return
        for p in self.model.parameters():
            if state == "offloaded":
                p.data = p.data.to(self.device)
            else:
                p.data = torch.zeros(p.shard_spec.local_shape(self.tp.size), dtype=p.dtype, device=self.device)
        self.weights_state = "resident"

    # ---- one step -------------------------------------------------------------------

    @property
    def inputs(self) -> StepInputBuilder:
        """Builds each step's input tensors in persistent buffers (made on first use)."""
        builder = self.__dict__.get("_inputs")
        if builder is None:
            builder = self._inputs = StepInputBuilder(self.block_size, self.device)
        return builder

    @property
    def seqs(self) -> dict[int, SeqState]:
        """Each live sequence's block table and sampling spec (the switch executor rewrites them)."""
        return self.inputs.seqs

    @seqs.setter
    def seqs(self, value: dict[int, SeqState]) -> None:
        self.inputs.seqs = value

    @torch.inference_mode()
    def execute(self, cmd: StepCommand) -> StepResult | None:
        start = time.perf_counter()
        with record_function("prepare"):
            step = self.inputs.build(cmd, samples=self.tp.rank == 0)
        ctx = ForwardContext(tp=self.tp, kv_caches=self.kv.layers, attn=step.attn)
        with record_function("forward"):
            hidden = self.model(step.input_ids, step.positions, ctx)
        with record_function("logits"):
            logits = self.model.compute_logits(hidden[step.logits_rows], self.tp)
        if logits is None:  # not the TP leader: nothing to report
            return None
        with record_function("sample"):
            tokens, logprobs = sample_batch(logits, step.sampling)
        return StepResult(cmd.step_id, self.layout.group_of(self.tp.ranks[0]), tokens, logprobs,
                          time.perf_counter() - start)
