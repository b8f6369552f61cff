"""InferExecutor: one rank's model shard, paged KV pool and batch forward.

The coordinator sends the same ``StepCommand`` to every rank of a DP group;
each rank runs its shard, TP rank 0 gathers the logits and samples. The
executor keeps each sequence's block table and sampling spec, so decode
messages stay small. Only the executor writes its own state: a layout switch
hands it the new group, pool and tables through ``install``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pat_engine.model.arch import ModelArch
from pat_engine.model.layers.attention import AttentionMetadata
from pat_engine.model.llama import CausalLM, ForwardContext
from pat_engine.model.weights import load_shard_from_disk
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.layout import Layout
from pat_engine.protocol import StepCommand, StepResult
from pat_engine.sampling.sampler import SamplingBatch, SamplingSpec, sample_batch
from pat_engine.worker.kv_pool import PagedKVPool
from pat_engine.protocol import PromptLogprobs
from pat_engine.worker.logprob_outputs import prompt_logprobs


@dataclass
class SeqState:
    block_table: list[int]
    sampling: SamplingSpec | None
    history: list[int] | None = None  # every token so far, kept for sequences with logit processors


class InferExecutor:
    def __init__(self, arch: ModelArch, layout: Layout, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 block_size: int, num_blocks: int):
        self.arch, self.layout, self.tp = arch, layout, tp
        self.dtype, self.device = dtype, device
        self.block_size = block_size
        self.model = CausalLM(arch, layout.tp, dtype, device)
        self.kv = self.new_pool(layout, num_blocks)
        self.seqs: dict[int, SeqState] = {}
        self._residency = "resident"  # where this rank's weight bytes are: "resident", "offloaded" or "released"

    def new_pool(self, layout: Layout, num_blocks: int, filled_later: bool = False) -> PagedKVPool:
        """A KV pool sized for ``layout``; ``filled_later``: no layers yet (a switch appends them one by one)."""
        geometry = (num_blocks, self.block_size, self.arch.kv_heads_per_rank(layout.tp), self.arch.head_dim,
                    self.dtype, self.device)
        if filled_later:
            return PagedKVPool.filled_later(*geometry)
        return PagedKVPool(self.arch.num_layers, *geometry)

    def allocate_kv(self, num_blocks: int) -> None:
        """A fresh, empty KV pool of ``num_blocks`` blocks under the current layout (start-up on GPU, wake-up)."""
        self.kv.release()
        self.kv = self.new_pool(self.layout, num_blocks)

    def install(self, layout: Layout, tp: TPGroup, pool: PagedKVPool, tables: dict[int, SeqState]) -> None:
        """Adopt a new layout after a switch: its TP group, its KV pool and the block tables of the
        sequences this rank now serves (their KV already sits in ``pool``)."""
        self.layout, self.tp, self.kv, self.seqs = layout, tp, pool, dict(tables)

    def load_weights(self, model_path: str) -> None:
        load_shard_from_disk(self.model, model_path, self.tp.rank, self.tp.size)

    # ---- memory release for colocated training (sleep / wake_up) ----------------------------

    def release_memory(self, level: int) -> int:
        """Level 1: drop the KV pool (and on GPU move weights to host); level 2: drop weights too."""
        freed = self.kv.nbytes
        self.allocate_kv(0)
        if level >= 2 or self.device.type != "cpu":
            for p in self.model.parameters():
                freed += p.numel() * p.element_size()
                p.data = torch.empty(0, dtype=p.dtype) if level >= 2 else p.data.to("cpu")
            self._residency = "released" if level >= 2 else "offloaded"
        return freed

    def restore_weights(self) -> None:
        """Bring weights back after ``release_memory``: from host memory, or zeroed (to be reloaded)."""
        if self._residency == "resident":
            return
        for p in self.model.parameters():
            if self._residency == "offloaded":
                p.data = p.data.to(self.device)
            else:
                p.data = torch.zeros(p.shard_spec.local_shape(self.tp.size), dtype=p.dtype, device=self.device)
        self._residency = "resident"

    # ---- one step -------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, cmd: StepCommand) -> StepResult | None:
        start = time.perf_counter()
        for seq_id in cmd.released:
            self.seqs.pop(seq_id, None)
        ids, positions, meta, last_index = self._prepare(cmd)
        ctx = ForwardContext(tp=self.tp, kv_caches=self.kv.layers, attn=meta)
        hidden = self.model(ids, positions, ctx)
        prompts = self._prompt_logprobs(cmd, hidden, meta)  # every TP rank joins the logits gather
        logits = self.model.compute_logits(hidden[last_index], self.tp)
        if logits is None:  # not the TP leader: nothing to report
            return None
        states = [self.seqs[s.seq_id] for s in cmd.seqs]
        batch = SamplingBatch.build([st.sampling for st in states], [s.start_pos + len(s.token_ids) for s in cmd.seqs],
                                    [s.suppressed for s in cmd.seqs], logits.device,
                                    [st.history for st in states], self.arch.vocab_size)
        out = sample_batch(logits, batch)
        return StepResult(cmd.step_id, self.layout.group_of(self.tp.ranks[0]), out.tokens, out.logprobs,
                          time.perf_counter() - start, out.top, prompts or None)

    def _prompt_logprobs(self, cmd: StepCommand, hidden: torch.Tensor, meta) -> dict[int, PromptLogprobs]:
        out = {}
        if not cmd.is_prefill:
            return out
        for i, s in enumerate(cmd.seqs):
            if s.prompt_logprobs is not None:
                rows = hidden[meta.query_starts[i] : meta.query_starts[i + 1]]
                result = prompt_logprobs(rows, s.token_ids, s.prompt_logprobs,
                                         lambda h: self.model.compute_logits(h, self.tp))
                if result is not None:
                    out[s.seq_id] = result
        return out

    def _prepare(self, cmd: StepCommand):
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        for s in cmd.seqs:
            if s.block_table is not None:
                history = list(s.context or []) if s.sampling is not None and s.sampling.has_processors else None
                self.seqs[s.seq_id] = SeqState(list(s.block_table), s.sampling, history)
            state = self.seqs[s.seq_id]
            if state.history is not None:  # the tokens run now take their positions in the history
                del state.history[s.start_pos :]
                state.history.extend(s.token_ids)
            state.block_table.extend(s.new_blocks)
            if s.sampling is not None:
                state.sampling = s.sampling
            ids.extend(s.token_ids)
            positions.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
            tables.append(state.block_table)
        dev = self.device
        pos_t = torch.tensor(positions, dtype=torch.long)
        table_t = _pad_tables(tables)
        seq_index = torch.repeat_interleave(torch.arange(len(cmd.seqs)), torch.tensor([len(s.token_ids) for s in cmd.seqs]))
        slots = table_t[seq_index, pos_t // bs] * bs + pos_t % bs  # (T,)
        if cmd.is_prefill:
            starts = [0]
            context_slots: list[torch.Tensor | None] = []
            for i, s in enumerate(cmd.seqs):
                starts.append(starts[-1] + len(s.token_ids))
                if s.start_pos == 0:
                    context_slots.append(None)
                else:
                    ctx_pos = torch.arange(s.start_pos + len(s.token_ids))
                    context_slots.append((table_t[i, ctx_pos // bs] * bs + ctx_pos % bs).to(dev))
            meta = AttentionMetadata(True, slots.to(dev), query_starts=starts,
                                     start_positions=[s.start_pos for s in cmd.seqs], context_slots=context_slots)
            last_index = torch.tensor(starts[1:], dtype=torch.long) - 1
        else:
            lengths = pos_t + 1  # context length after writing this token
            nb = -(-int(lengths.max()) // bs)
            mask = torch.arange(nb * bs)[None, :] < lengths[:, None]  # (B, nb*bs)
            meta = AttentionMetadata(False, slots.to(dev), block_tables=table_t[:, :nb].to(dev),
                                     decode_mask=mask[:, None, None, :].to(dev), context_lens=lengths.to(dev))
            last_index = torch.arange(len(cmd.seqs))
        return (torch.tensor(ids, dtype=torch.long, device=dev), pos_t.to(dev), meta, last_index.to(dev))


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
