"""Decode graphs: the decode forward of each padded batch size captured once, then replayed.

A decode step launches a few hundred small kernels; on a GPU at small batches their launches, not
the math, bound the step. A CUDA graph records them once for one batch size over fixed addresses
and replays them with one launch. ``DecodeGraphs`` owns all of it for one rank:

- **The ladder** (``config.graph_ladder``): 1, 2, 4, 8, 16, 24, ... up to ``max_graph_batch``
  (capped at ``max_num_seqs``). A decode batch of n rows replays the graph of the smallest ladder
  size >= n.
- **Persistent inputs** (``_GraphBuffers``), sized for the largest ladder size and shared by every
  size: a size-B graph reads their first B rows, so one set of addresses serves the whole ladder.
  Token ids, positions, KV slots, block tables (as wide as ``max_model_len`` allows) and context
  lengths; the attention mask is computed inside the graph from the lengths. Each graph owns its
  output, the final hidden states (B, hidden). The LM head's vocab gather, sampling, logit
  processors and log-probs run eagerly on its first n rows, so none of them forces the eager path.
- **Padding rows** run token 0 at position 0 with context length 1 over the pool's scratch block
  (``PagedKVPool.scratch``: one block past the driver's, owned by no sequence). They write their K/V
  there and read only it; rows never mix in the forward, so padding cannot change a real row.
- **Eager fallbacks**: prefill (and the invariant mode's decode-shaped prefill), a batch past the
  ladder, a step with several tokens per sequence, a table wider than ``max_model_len`` allows.
- **Groups no graph can record**: a TP group of ranks sharing one GPU runs its collectives on host
  copies through gloo (parallel/devices.py), which a CUDA graph cannot hold. Such a group captures
  nothing (no capture is tried) and decodes eagerly; its TP1 layouts keep their graphs.

What a graph holds, and so when it must go:
- the TP group's communicator and the KV pool's layer tensors. A layout switch brings another group
  and another pool geometry (other heads per rank, another block count): the graphs of the layout it
  leaves are set aside (``set_aside``), with the addresses of everything they read. A switch keeps
  every weight and KV layer at one address across layouts (the weights are resharded into their own
  storage, the KV layers re-viewed in their memory: core/memory.py gives every higher TP the base's
  bytes), so a return to a layout finds them where its graphs left them and replays those graphs again
  without capturing anything (``GraphStats.restored``): the way back to the base layout that every RL
  rollout round makes after its tail merge, and the next round's merge. Graphs whose addresses moved
  are dropped. A switch then captures, inside its timed ``graphs_s`` phase, only the sizes its
  unfinished requests can still reach that it does not have (``SwitchPlan.group_requests`` for this
  rank's DP group rounded up to a ladder size, and every smaller size: a batch only shrinks until new
  requests arrive). Any other size is captured the first time a step needs it (requests arriving
  after the switch, the first steps after a wake-up). Releasing the KV or the weights (sleep) drops
  every graph, those set aside too.
- the weights' storage. An RL weight update copies into the same tensors and keeps the graphs; a
  write that moves any parameter, or that rebuilds derived copies (CPU GEMM packs, the invariant
  mode's chunk pieces), drops them (``after_weight_write``).
What survives a layout change: the input buffers (their sizes depend on ``max_graph_batch`` and
``max_model_len`` only), the ladder, and the shapes this rank has captured (``CaptureWarmups``): a
capture runs its forward unrecorded first, so that nothing initialises lazily while it records,
unless this process has captured the same forward before (the same batch size, weight and KV shapes)
in a one-rank group: then nothing is left to initialise and the warm-ups are skipped. A switch back to
TP1, as every RL rollout round makes, a wake-up, a weight write that moved the weights: all capture
shapes seen before. The ranks of a larger group always warm up: their warm-up forwards hold
collectives, so every rank must run as many, and their pools' geometries may differ.

Every rank of a TP group captures the same sizes in the same order, as the collectives recorded
inside must pair up: every decision above follows calls and steps the whole group receives.

How a forward becomes replayable is a ``GraphBackend`` (worker/graph_backends.py): CUDA graphs, or
the CPU stand-in that replays the recorded forward eagerly over the same persistent buffers, so the
ladder, the padding and the copies in and out run exactly as on a GPU.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Hashable
from dataclasses import asdict, dataclass

import torch

from pat_engine.config import EngineConfig, graph_sizes_upto
from pat_engine.model.arch import ModelArch
from pat_engine.model import chunk_weights, cpu_gemm
from pat_engine.model.layers.attention import DEFAULT_BACKEND, AttentionBackend, AttentionMetadata
from pat_engine.model.llama import ForwardContext
from pat_engine.parallel.comm import TPGroup
from pat_engine.protocol import StepCommand
from pat_engine.worker.graph_backends import CapturedGraph, GraphBackend, make_backend
from pat_engine.worker.kv_pool import PagedKVPool
from pat_engine.worker.step_inputs import StepInputs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphSettings:
    """What a rank needs to capture decode graphs; ``from_config`` gives None when graphs are off."""

    backend: str  # "cuda" or "standin"
    ladder: tuple[int, ...]  # batch sizes, ascending
    max_context: int  # tokens a sequence can reach: the block tables' width

    @classmethod
    def from_config(cls, cfg: EngineConfig, arch: ModelArch) -> GraphSettings | None:
        backend = cfg.graphs(arch)
        if backend is None:
            if cfg.graphs() is not None:
                log.info("%s decodes without CUDA graphs: its layers pick their experts on the host", arch.architecture)
            return None
        return cls(backend, cfg.decode_graph_ladder(arch), min(cfg.max_model_len or arch.max_position, arch.max_position))


class _GraphBuffers:
    """The persistent inputs; a size-B graph reads their first B rows. R = the largest ladder size,
    W = blocks of a sequence at ``max_model_len``."""

    def __init__(self, rows: int, max_blocks: int, block_size: int, device: torch.device):
        long = dict(dtype=torch.long, device=device)
        self.ids = torch.zeros(rows, **long)  # (R,) each row's token
        self.pos = torch.zeros(rows, **long)  # (R,) its position
        self.slots = torch.zeros(rows, **long)  # (R,) the KV slot its token writes
        self.tables = torch.zeros(rows, max_blocks, **long)  # (R, W) its sequence's blocks
        self.lens = torch.ones(rows, **long)  # (R,) context length, the new token included
        self.block_size = block_size

    def load(self, step: StepInputs, n: int, b: int, scratch_block: int) -> None:
        """Rows [0, n) from the eager step's tensors, rows [n, b) padding."""
        attn = step.attn
        self.ids[:n].copy_(step.input_ids[:n])
        self.pos[:n].copy_(step.positions[:n])
        self.slots[:n].copy_(attn.slot_mapping[:n])
        self.lens[:n].copy_(attn.context_lens[:n])
        self.tables[:n].fill_(scratch_block)  # entries past a row's own blocks: never read unmasked
        self.tables[:n, : attn.block_tables.shape[1]].copy_(attn.block_tables[:n])
        self.pad(n, b, scratch_block)

    def pad(self, start: int, stop: int, scratch_block: int) -> None:
        """Rows [start, stop): token 0 at position 0, context 1, all in the scratch block."""
        self.ids[start:stop].zero_()
        self.pos[start:stop].zero_()
        self.slots[start:stop].fill_(scratch_block * self.block_size)
        self.lens[start:stop].fill_(1)
        self.tables[start:stop].fill_(scratch_block)


@dataclass(frozen=True)
class CaptureWarmups:
    """Unrecorded forwards before a capture of shapes this process has not captured yet: ``first`` for an
    epoch's first capture (a new group, pool or weights: what they initialise lazily, e.g. an NCCL
    communicator's connections, may take more than one call), ``later`` for the epoch's other sizes
    (whatever a new batch size initialises, a Triton specialisation or a GEMM heuristic, the first warm-up
    runs). Shapes a one-rank group captured before take none. The fourth H100 run
    (bench/results/gpu_check.md, switch part, 1B shape, sizes up to 32): 37.6 ms a size with 2 warm-ups
    each, 21.5 ms with 2 then 1: a warm-up forward is about as long as the rest of a capture."""

    first: int = 2
    later: int = 1


@dataclass
class GraphStats:
    captures: int = 0
    capture_s: float = 0.0
    warmup_forwards: int = 0  # run before captures; none for shapes captured before
    lazy_captures: int = 0  # captured by a step that needed the size
    restored: int = 0  # graphs a layout left behind, replayed again on a return to it (no capture)
    replays: int = 0
    eager_decodes: int = 0  # decode steps no graph could hold
    uncapturable_decodes: int = 0  # of those, steps of a TP group whose collectives no graph can record

    def to_dict(self) -> dict:
        return {**asdict(self), "capture_s_per_size": self.capture_s / self.captures if self.captures else 0.0}


def _where(t: torch.Tensor) -> tuple:
    """What a graph recorded of a tensor it reads: its address and its layout there."""
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


def _weights_key(model: torch.nn.Module) -> tuple | None:
    """Where every weight tensor the forward reads lives; None where derived copies exist (they are rebuilt
    on every write, so graphs never survive one)."""
    params = list(model.parameters())
    if any(hasattr(p, cpu_gemm.PACKED_ATTR) or hasattr(p, chunk_weights.DERIVED_ATTR) for p in params):
        return None
    return tuple(_where(t) for t in [*params, *model.buffers()])


@dataclass
class _LeftGraphs:
    """The graphs of a layout a switch left, kept for a return to it (``DecodeGraphs.set_aside``)."""

    tp: TPGroup  # the layout's group (the pool of groups keeps one object per layout)
    graphs: dict[int, CapturedGraph]
    addresses: tuple  # everything they read: weights, KV layers, the scratch block (``DecodeGraphs._addresses``)
    epoch: object  # their memory pool (``GraphBackend.epoch``)


class DecodeGraphs:
    """One rank's decode graphs (see the module docstring). Disabled (every step eager, no scratch
    block) when ``settings`` is None."""

    def __init__(self, settings: GraphSettings | None, device: torch.device, block_size: int,
                 backend: GraphBackend | None = None, attention: AttentionBackend = DEFAULT_BACKEND):
        self.attention = attention  # the executor's: a graph runs the kernels an eager step would
        self.ladder: tuple[int, ...] = settings.ladder if settings else ()
        self.device, self.block_size = device, block_size
        self.max_blocks = math.ceil(settings.max_context / block_size) if settings else 0
        self.backend = backend or (make_backend(settings.backend, device) if settings else None)
        self.graphs: dict[int, CapturedGraph] = {}  # batch size -> its graph
        self.stats = GraphStats()
        self.warmups = CaptureWarmups()
        self._warm: set[Hashable] = set()  # capture keys (size, shapes) this process has captured at TP1
        self._bufs: _GraphBuffers | None = None
        self._model: torch.nn.Module | None = None  # what the graphs were captured over
        self._tp: TPGroup | None = None
        self._pool: PagedKVPool | None = None
        self._layer0: torch.Tensor | None = None  # the pool's first layer then (a released pool has none)
        self._weights: tuple | None = None
        self._shapes: Hashable | None = None  # what a capture's kernels depend on besides its size (_bind)
        self._left: dict[int, _LeftGraphs] = {}  # id(TP group) -> the graphs its layout left (set_aside)

    @property
    def enabled(self) -> bool:
        """Whether graphs are on (the KV pool then needs its scratch block)."""
        return bool(self.ladder)

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self.graphs))

    def reserve_bytes(self, hidden: int, intermediate_per_rank: int, elt: int) -> int:
        """GPU memory the graphs' pool keeps beyond the KV budget (an estimate, not measured): the largest
        size's activations, which every smaller size reuses, and each size's own output."""
        if not self.enabled:
            return 0
        return (self.ladder[-1] * (4 * hidden + 2 * intermediate_per_rank) + sum(self.ladder) * hidden) * elt

    def drop(self) -> None:
        """Forget every graph and what they were captured over (their pool's layers among it)."""
        if self.graphs and self.backend is not None:
            self.backend.new_epoch()
        self.graphs.clear()
        self._model = self._tp = self._pool = self._layer0 = self._weights = self._shapes = None

    def drop_all(self) -> None:
        """``drop``, and the graphs layouts left behind: the memory they read is going (released, reloaded)."""
        self.drop()
        self._left.clear()

    def set_aside(self) -> tuple[int, ...]:
        """A switch begins: keep this layout's graphs for a return to it, which restores them when every
        address they read is the same again (``_bind``); none of them runs meanwhile. Returns the batch
        sizes set aside (what a return need not capture: the predictor's price)."""
        left: tuple[int, ...] = ()
        if self.graphs and self._weights is not None:
            self._left[id(self._tp)] = _LeftGraphs(self._tp, dict(self.graphs), self._addresses(),
                                                   self.backend.epoch())
            left = self.captured
        self.drop()
        return left

    def forget_warm_shapes(self) -> None:
        """Capture every shape as if for the first time: with ``CaptureWarmups`` (benchmarks)."""
        self._warm.clear()

    def after_weight_write(self, model: torch.nn.Module) -> None:
        """A weight write ended: keep the graphs only if every tensor they read stayed where it was."""
        if self.graphs and (self._weights is None or _weights_key(model) != self._weights):
            self.drop()

    def capture(self, model: torch.nn.Module, tp: TPGroup, pool: PagedKVPool, upto: int | None = None) -> tuple[int, float]:
        """Capture the sizes a batch of at most ``upto`` rows can run as (every size for None) that are
        not captured yet; returns (how many were captured, seconds)."""
        if not self.enabled or pool.scratch_block is None or not pool.layers:  # off, or the KV is released
            return 0, 0.0
        if not tp.graphs_capturable:  # host-staged collectives: eager, without trying a capture
            return 0, 0.0
        sizes = self.ladder if upto is None else graph_sizes_upto(self.ladder, upto)
        start = time.perf_counter()
        self._bind(model, tp, pool)
        todo = [b for b in sorted(sizes, reverse=True) if b not in self.graphs]  # largest first (shared pool)
        for b in todo:
            self._capture_one(b)
        return len(todo), time.perf_counter() - start

    def replay(self, cmd: StepCommand, step: StepInputs, model: torch.nn.Module, tp: TPGroup,
               pool: PagedKVPool) -> torch.Tensor | None:
        """The decode forward of ``step`` through a graph: hidden states (B, hidden) whose first
        ``len(cmd.seqs)`` rows are the real ones; None when no graph can hold the step (run it eagerly)."""
        if not self.enabled or cmd.is_prefill:
            return None
        if not tp.graphs_capturable:
            self.stats.eager_decodes += 1
            self.stats.uncapturable_decodes += 1
            return None
        n = len(cmd.seqs)
        attn = step.attn
        if (n > self.ladder[-1] or pool.scratch_block is None or attn.context_lens is None or attn.query_len != 1
                or attn.block_tables.shape[1] > self.max_blocks or any(len(s.token_ids) != 1 for s in cmd.seqs)):
            self.stats.eager_decodes += 1
            return None
        self._bind(model, tp, pool)  # a guard: the executor drops the graphs whenever these change
        b = next(s for s in self.ladder if s >= n)
        graph = self.graphs.get(b)
        if graph is None:
            graph = self._capture_one(b)
            self.stats.lazy_captures += 1
        self._bufs.load(step, n, b, pool.scratch_block)
        graph.replay()
        self.stats.replays += 1
        return graph.output

    # ---- internals -------------------------------------------------------------------------------

    def _bind(self, model: torch.nn.Module, tp: TPGroup, pool: PagedKVPool) -> None:
        """Graphs are captured over one (model, TP group, pool); anything else drops them first."""
        same = (self._model is model and self._tp is tp and self._pool is pool
                and bool(pool.layers) and self._layer0 is pool.layers[0])
        if same:
            return
        self.drop()
        self._model, self._tp, self._pool = model, tp, pool
        self._layer0 = pool.layers[0] if pool.layers else None
        self._weights = _weights_key(model)
        self._restore(tp)
        # what the recorded kernels depend on besides the batch size: the rank's weight shapes and the pool's
        # geometry (a new shape may be a new specialisation). None for a group of several ranks (every capture
        # warmed up): their warm-ups hold collectives, which pair up only if every rank runs as many
        layer0 = self._layer0
        self._shapes = None if tp.size > 1 else (
            tuple(layer0.shape), layer0.stride(), layer0.dtype,
            tuple((tuple(p.shape), p.dtype) for p in model.parameters()))
        if self._bufs is None:  # they survive every drop: their sizes depend on no layout
            with torch.inference_mode():
                self._bufs = _GraphBuffers(self.ladder[-1], self.max_blocks, self.block_size, self.device)

    def _addresses(self) -> tuple:
        """Everything the bound graphs read besides the persistent buffers (kept for the worker's life)."""
        return self._weights, tuple(_where(layer) for layer in self._pool.layers), self._pool.scratch_block

    def _restore(self, tp: TPGroup) -> None:
        """Take back the graphs this layout left, if everything they read is where it was then: the weights
        (resharded into their own storage: worker/switch_executor.into_own_storage) and the KV layers
        (re-viewed in their memory: PagedKVPool.append_layer_from) normally are."""
        left = self._left.pop(id(tp), None)
        if left is None or left.tp is not tp or self._weights is None or left.addresses != self._addresses():
            return  # dropped: something moved, so they can never run again
        self.graphs.update(left.graphs)
        self.backend.resume_epoch(left.epoch)
        self.stats.restored += len(left.graphs)

    @torch.inference_mode()
    def _capture_one(self, b: int) -> CapturedGraph:
        start = time.perf_counter()
        bufs, scratch = self._bufs, self._pool.scratch_block
        bufs.pad(0, b, scratch)  # every row padding: warm-up and capture write only the scratch block
        model, tp, layers = self._model, self._tp, list(self._pool.layers)
        ids, pos, slots, tables, lens = bufs.ids[:b], bufs.pos[:b], bufs.slots[:b], bufs.tables[:b], bufs.lens[:b]

        def forward() -> torch.Tensor:
            attn = AttentionMetadata(is_prefill=False, slot_mapping=slots, query_len=1, block_tables=tables,
                                     context_lens=lens)  # the torch path derives its mask from lens
            return model(ids, pos, ForwardContext(tp=tp, kv_caches=layers, attn=attn,
                                                  attn_backend=self.attention))  # (b, hidden)

        graph = self.graphs[b] = self._warmed_capture(forward, None if self._shapes is None else (b, self._shapes))
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - start
        return graph

    def _warmed_capture(self, forward, key: Hashable | None) -> CapturedGraph:
        """The backend's capture with the warm-ups ``CaptureWarmups`` asks (``key``: the size and shapes, None
        where every capture warms up); should a capture without any fail all the same, it is taken again
        after the full warm-up, with a warning (an initialisation this rule did not foresee: a bug to
        report, not a reason to fail the step or the switch)."""
        if key is not None and key in self._warm:
            try:
                return self.backend.capture(forward, 0)
            except RuntimeError as exc:
                log.warning("a decode graph capture without warm-up failed (%s: %s); capturing it again after "
                            "%d warm-up forwards", type(exc).__name__, exc, self.warmups.first)
                self._warm.discard(key)
                warmups = self.warmups.first
        else:
            warmups = self.warmups.first if not self.graphs else self.warmups.later
        graph = self.backend.capture(forward, warmups)
        self.stats.warmup_forwards += warmups
        if key is not None:
            self._warm.add(key)
        return graph
