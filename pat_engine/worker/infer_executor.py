"""InferExecutor: one rank's model shard, paged KV pool and batch forward.

The coordinator sends the same ``StepCommand`` to every rank of a DP group;
each rank runs its shard, TP rank 0 gathers the logits and samples. The
executor keeps each sequence's block table and sampling spec, so decode
messages stay small. Only the executor writes its own state: a layout switch
hands it the new group, pool and tables through ``install``. A decode step replays a captured
graph where one holds it (``self.graphs``, worker/graph_capture.py).

``numerics="invariant"`` (docs/numerics.md) builds the model with the declared reduction width
(``max_tp``, ``ModelArch.reduction_width``) as the row-parallel chunk count (one fixed reduction
tree for every layout and deployment size up to it), puts every GEMM on the invariant one
(layers/linear.py) and runs prefill attention through the decode kernel (prefilled KV = decoded
KV, bit for bit).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.profiler import record_function

from pat_engine.config import DEFAULT_MAX_TP
from pat_engine.host_tensors import to_device
from pat_engine.model import chunk_weights, cpu_gemm
from pat_engine.model.arch import ModelArch
from pat_engine.model.layers import moe
from pat_engine.model.layers.attention import attention_backend
from pat_engine.model.layers.triton_ops import launch_policy, launches_with_pdl
from pat_engine.model.llama import CausalLM, ForwardContext
from pat_engine.model.weights import load_shard_from_disk, load_shard_from_tensors
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.layout import Layout
from pat_engine.protocol import StepCommand, StepResult
from pat_engine.protocol import PromptLogprobs
from pat_engine.sampling.inverse_cdf import batch_invariant_draws
from pat_engine.sampling.sampler import HostTransfer, sample_on_device
from pat_engine.worker.device_memory import release_cached
from pat_engine.worker.graph_capture import DecodeGraphs, GraphSettings
from pat_engine.speculative.verify import accept
from pat_engine.worker.kv_pool import PagedKVPool
from pat_engine.worker.logprob_outputs import prompt_logprobs
from pat_engine.worker.step_inputs import SeqState, StepInputBuilder

try:  # the kernels package sits beside the engine in a checkout and in an install
    from pat_kernels.cpu_extension import switches_read_once
except ImportError:  # pragma: no cover - a partial install: no CPU kernel switches to read
    switches_read_once = contextlib.nullcontext


class InferExecutor:
    def __init__(self, arch: ModelArch, layout: Layout, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 block_size: int, num_blocks: int, lazy_kv: bool = False, numerics: str = "fast",
                 attention: str = "auto", graphs: GraphSettings | None = None, max_tp: int = DEFAULT_MAX_TP):
        self.arch, self.layout, self.tp = arch, layout, tp
        self.lazy_kv = lazy_kv  # KV memory committed as it fills (the default-sized CPU pool; worker/kv_pool.zeroed)
        self.dtype, self.device = dtype, device
        self.block_size = block_size
        self.numerics = numerics
        self.row_chunks = arch.reduction_width(max_tp) if numerics == "invariant" else None
        self._check_tp(layout)
        self.model = CausalLM(arch, layout.tp, dtype, device, row_chunks=self.row_chunks)
        self.attention = attention_backend(attention, numerics, device)
        self.attention.load(device, dtype)  # kernels built now, not in a DP group's first step (refuses an
        # invariant mode no decode kernel can keep)
        self.graphs = DecodeGraphs(graphs, device, block_size, attention=self.attention)  # worker/graph_capture.py
        self.kv = self.new_pool(layout, num_blocks)  # with the graphs' scratch block when they are on
        # also keeps each sequence's table; invariant: prefill attention through the decode kernel (bit-equal KV)
        self.inputs = StepInputBuilder(block_size, device, arch.vocab_size, prefill_as_decode=numerics == "invariant")
        self._residency = "resident"  # where this rank's weight bytes are: "resident", "offloaded" or "discarded"
        self.kv_released = False  # the KV pool was given back (sleep); no step may run until it is restored
        self._writers = 0  # open ``writing_weights`` blocks
        self._last_draw: tuple[int, torch.Tensor] | None = None  # TP rank 0: (step id, its drawn tokens)
        # the invariant mode's draws may not depend on the batch: on CUDA ATen's scan does (docs/numerics.md)
        self.batch_invariant_draws = numerics == "invariant" and device.type == "cuda"
        # PAT_PDL: this rank's Triton kernels (and the graphs capturing them) launch with PDL (launch_policy)
        self.pdl = launches_with_pdl(device)

    @contextlib.contextmanager
    def writing_weights(self) -> Iterator[None]:
        """Every write to the weights happens inside this block: the CPU GEMM packs derived from
        them (model/cpu_gemm.py), and the invariant mode's chunk pieces (model/chunk_weights.py), are
        dropped on entry and rebuilt when the outermost block ends; so are the fused MoE layers' tables of
        their experts' weights (model/layers/moe.py)."""
        if self._writers == 0:
            cpu_gemm.drop(self.model)
            chunk_weights.drop(self.model)
        self._writers += 1
        try:
            yield
        finally:
            self._writers -= 1
            if self._writers == 0 and self._residency == "resident":
                cpu_gemm.pack(self.model)
                chunk_weights.pack(self.model)
                moe.refresh_expert_tables(self.model)
            if self._writers == 0:
                self.graphs.after_weight_write(self.model)  # kept only if no tensor they read moved

    def new_pool(self, layout: Layout, num_blocks: int, filled_later: bool = False) -> PagedKVPool:
        """A KV pool sized for ``layout``; ``filled_later``: no layers yet (a switch appends them one by one)."""
        geometry = (num_blocks, self.block_size, self.arch.kv_heads_per_rank(layout.tp), self.arch.head_dim,
                    self.dtype, self.device, self.lazy_kv, self.graphs.enabled)  # + graphs' scratch block
        if filled_later:
            return PagedKVPool.filled_later(*geometry)
        return PagedKVPool(self.arch.num_layers, *geometry)

    def allocate_kv(self, num_blocks: int) -> None:
        """A fresh, empty KV pool of ``num_blocks`` blocks under the current layout (start-up on GPU, wake-up)."""
        self.graphs.drop_all()
        self.kv.release()
        self.kv = self.new_pool(self.layout, num_blocks)

    def install(self, layout: Layout, tp: TPGroup, pool: PagedKVPool, tables: dict[int, SeqState]) -> None:
        """Adopt a new layout after a switch: its TP group, its KV pool and the block tables of the
        sequences this rank now serves (their KV already sits in ``pool``)."""
        self._check_tp(layout)
        self.layout, self.tp, self.kv = layout, tp, pool
        self.inputs.seqs = dict(tables)
        self.graphs.drop()  # captured over the old group and pool; the switch restores or captures (capture_graphs)

    def _check_tp(self, layout: Layout) -> None:
        if self.row_chunks is not None and self.row_chunks % layout.tp:
            raise ValueError(f"numerics='invariant': TP {layout.tp} does not divide the {self.row_chunks} "
                             "row-parallel chunks (declare a larger max_tp)")

    def capture_graphs(self, upto: int | None = None) -> tuple[int, float]:
        """Capture the decode graphs a batch of at most ``upto`` sequences can use (all for None), over
        the current group and pool; returns (graphs captured, seconds). Nothing when graphs are off."""
        with launch_policy(self.pdl):
            return self.graphs.capture(self.model, self.tp, self.kv, upto)

    def load_weights(self, model_path: str) -> None:
        with self.writing_weights():
            self.restore_weights()
            load_shard_from_disk(self.model, model_path, self.tp.rank, self.tp.size)

    def load_tensors(self, tensors: list) -> int:
        """Load full HF-named tensors into this rank's shards; returns how many were loaded."""
        with self.writing_weights():
            self.restore_weights()
            return len(load_shard_from_tensors(self.model, tensors, self.tp.rank, self.tp.size))

    # ---- memory release for colocated training (sleep / wake_up) ----------------------------

    def release_memory(self, kv: bool, weights: str | None) -> int:
        """Give memory back; returns the bytes freed. ``kv``: the KV pool (the driver has taken every
        sequence's blocks back first); ``weights``: "offloaded" to host memory or "discarded"."""
        freed = 0
        self.graphs.drop_all()  # they read the pool and the weights (the "cuda_graph" tag goes with either)
        if kv:
            freed += self.kv.nbytes
            self.kv.release()
            self.kv_released = True
            self.inputs.seqs.clear()  # no block table may point into a pool that is gone
        if weights is not None and self._residency == "resident":
            with self.writing_weights():
                for p in self.model.parameters():
                    freed += p.numel() * p.element_size()
                    p.data = torch.empty(0, dtype=p.dtype) if weights == "discarded" else p.data.to("cpu")
                self._residency = weights
        release_cached(self.device)
        return freed

    def restore_memory(self, kv_blocks: int | None, weights: bool) -> None:
        """Undo ``release_memory``: the weights (from host memory, or zeroed for a reload) and a fresh
        KV pool of ``kv_blocks`` blocks. Restoring a pool that was not released is refused: it would
        wipe the KV that running sequences and the driver's prefix cache point into."""
        if weights:
            self.restore_weights()
        if kv_blocks is not None:
            if not self.kv_released:
                raise RuntimeError("asked to restore a KV pool that was never released (it holds live KV)")
            self.kv = self.new_pool(self.layout, kv_blocks)
            self.kv_released = False

    def restore_weights(self) -> None:
        """Bring weights back after ``release_memory``: from host memory, or zeroed (to be reloaded)."""
        if self._residency == "resident":
            return
        with self.writing_weights():
            for p in self.model.parameters():
                if self._residency == "offloaded":
                    p.data = p.data.to(self.device)
                else:
                    p.data = torch.zeros(p.shard_spec.local_shape(self.tp.size), dtype=p.dtype, device=self.device)
            self._residency = "resident"

    # ---- one step -------------------------------------------------------------------

    @property
    def seqs(self) -> dict[int, SeqState]:
        """Each live sequence's block table, sampling spec and (with logit processors) token history."""
        return self.inputs.seqs

    def execute(self, cmd: StepCommand) -> StepResult | None:
        """Run one step and answer it (TP rank 0; other ranks return None)."""
        launched = self.launch(cmd)
        return launched.answer() if launched is not None else None

    @torch.inference_mode()
    def launch(self, cmd: StepCommand) -> "LaunchedStep | None":
        """Queue one step's work: inputs, forward, LM head and the draw, nothing read back. TP rank 0
        gets the step to answer (``LaunchedStep.answer``); the other ranks None."""
        # graphs captured lazily by the step capture its launches too; the CPU kernels' switches read once a step
        with launch_policy(self.pdl), switches_read_once():
            return self._launch(cmd)

    def _launch(self, cmd: StepCommand) -> "LaunchedStep | None":
        if self.kv_released or self._residency != "resident":
            raise RuntimeError("a step arrived while this rank's memory is released (sleep); the driver must not "
                               "dispatch until wake_up restores it")
        start = time.perf_counter()
        with record_function("prepare"):
            step = self.inputs.build(cmd, samples=self.tp.rank == 0, drawn=self._drawn_tokens(cmd))
        ctx = ForwardContext(tp=self.tp, kv_caches=self.kv.layers, attn=step.attn, attn_backend=self.attention)
        with record_function("forward"):
            hidden = self.graphs.replay(cmd, step, self.model, self.tp, self.kv)  # None: no graph holds the step
            if hidden is None:
                hidden = self.model(step.input_ids, step.positions, ctx)
        prompts = self._prompt_logprobs(cmd, hidden)  # every TP rank joins these logits gathers
        head_start = time.perf_counter()
        with record_function("logits"):
            logits = self.model.compute_logits(hidden[step.logits_rows], self.tp)
        if logits is None:  # not the TP leader: nothing to report
            return None
        sample_start = time.perf_counter()
        with record_function("sample"), batch_invariant_draws(self.batch_invariant_draws):
            draw = sample_on_device(logits, step.sampling, logits_owned=True)  # this step's own logits
        self._last_draw = (cmd.step_id, draw.tokens)  # what a step that follows this one runs
        # the copy back is queued now: a step launched before this one is answered must not delay it
        return LaunchedStep(cmd, self.layout.group_of(self.tp.ranks[0]), draw.start_transfer(), prompts, start,
                            sample_start - head_start, sample_start)

    def _drawn_tokens(self, cmd: StepCommand) -> torch.Tensor | None:
        """The tokens of a step that follows another (``StepCommand.follows``): each row's draw of the
        followed step, gathered on the device; TP rank 0 drew them, the other ranks receive them."""
        if cmd.follows is None:
            return None
        if self.tp.rank == 0:
            step_id, tokens = self._last_draw if self._last_draw is not None else (None, None)
            if step_id != cmd.follows:
                raise RuntimeError(f"step {cmd.step_id} follows step {cmd.follows}, but this rank's last draw is "
                                   f"step {step_id}'s")
            ids = tokens.index_select(0, to_device([s.drawn_row for s in cmd.seqs], torch.long, self.device))
        else:
            ids = torch.zeros(len(cmd.seqs), dtype=torch.long, device=self.device)
        return self.tp.all_gather(ids)[0] if self.tp.size > 1 else ids

    def _prompt_logprobs(self, cmd: StepCommand, hidden: torch.Tensor) -> dict[int, PromptLogprobs]:
        """Prompt log-probs of the sequences that asked (a prefill packs each one's tokens in order)."""
        out: dict[int, PromptLogprobs] = {}
        if not cmd.is_prefill or not any(s.prompt_logprobs is not None for s in cmd.seqs):
            return out
        start = 0
        for s in cmd.seqs:
            end = start + len(s.token_ids)
            if s.prompt_logprobs is not None:
                result = prompt_logprobs(hidden[start:end], s.token_ids, s.prompt_logprobs,
                                         lambda h: self.model.compute_logits(h, self.tp))
                if result is not None:
                    out[s.seq_id] = result
            start = end
        return out


@dataclass
class LaunchedStep:
    """A step TP rank 0 has launched and not answered yet."""

    cmd: StepCommand
    group: int
    transfer: HostTransfer  # its draw, on its way to host memory
    prompts: dict[int, PromptLogprobs]
    start: float  # perf_counter at the step's start
    head_seconds: float
    sample_start: float

    def answer(self) -> StepResult:
        """Read the draw back (waits for this step's kernels, not a later step's) and build the result."""
        out = self.transfer.result()
        counts = None
        if self.cmd.verify:  # speculative decoding: keep each row's accepted drafts and one more token
            out, counts = accept([s.token_ids[1:] for s in self.cmd.seqs], out)
        end = time.perf_counter()
        return StepResult(self.cmd.step_id, self.group, out.tokens, out.logprobs, end - self.start, out.top,
                          self.prompts or None, head_seconds=self.head_seconds,
                          sample_seconds=end - self.sample_start, counts=counts)
