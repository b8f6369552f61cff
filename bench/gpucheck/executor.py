"""One TP1 ``InferExecutor`` in this process, driven the way the scheduler drives a worker: the kernels
and prefill parts time and profile its steps without the driver's round trip in the way."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from gpucheck.shared import BLOCK_SIZE, Ctx, log, synchronize
from pat_engine.model.arch import load_model_arch
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.layout import Layout
from pat_engine.protocol import SeqStep, StepCommand
from pat_engine.sampling.spec import SamplingSpec
from pat_engine.worker.graph_capture import DecodeGraphs, GraphSettings
from pat_engine.worker.infer_executor import InferExecutor

GREEDY = SamplingSpec(temperature=0.0, top_k=-1, top_p=1.0, seed=0, logprobs=False)


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def build(ctx: Ctx, num_blocks: int, ladder: tuple[int, ...] = (), max_context: int = 0,
          numerics: str = "fast", ckpt: Path | None = None) -> InferExecutor:
    """The checkpoint's TP1 shard (the run's, or ``ckpt``) with the engine's defaults (attention "auto",
    numerics "fast" unless given); decode graphs for the ``ladder`` sizes (CUDA graphs; the stand-in on the
    CPU), none when it is empty."""
    ckpt = ckpt or ctx.checkpoint()
    settings = GraphSettings("standin" if ctx.smoke else "cuda", ladder, max_context) if ladder else None
    t = time.perf_counter()
    ex = InferExecutor(load_model_arch(str(ckpt)), Layout(1, 1), TPGroup(rank=0, size=1, ranks=(0,)), ctx.dtype,
                       torch.device(ctx.device), BLOCK_SIZE, num_blocks, graphs=settings, numerics=numerics)
    ex.load_weights(str(ckpt))
    synchronize(ctx.device)
    log(f"in-process executor ({num_blocks} blocks, graphs {list(ladder) or 'off'}) loaded in "
        f"{time.perf_counter() - t:.1f}s")
    return ex


@contextlib.contextmanager
def eager(ex: InferExecutor) -> Iterator[None]:
    """Steps inside run without graphs (as ``enforce_eager`` would), on the same weights and pool."""
    saved = ex.graphs
    ex.graphs = DecodeGraphs(None, ex.device, ex.block_size)  # disabled: every step eager
    try:
        yield
    finally:
        ex.graphs = saved


@contextlib.contextmanager
def step_variant(ex: InferExecutor, graphs: DecodeGraphs, skinny_rows: int | None = None,
                 fuse_reduce: bool | None = None, prologue_rows: int | None = None,
                 pdl: bool | None = None) -> Iterator[None]:
    """Steps inside run another way, replaying ``graphs`` (captured that way) in place of the executor's:
    ``skinny_rows`` as ``PAT_SKINNY_GEMM=<rows>`` builds the layers (each fast-mode linear's set),
    ``prologue_rows`` as ``PAT_GEMM_PROLOGUE=fused`` does (the linears that take a deferred input),
    ``fuse_reduce`` as ``PAT_DECODE_REDUCE=fused`` builds the Triton attention, and/or ``pdl`` as
    ``PAT_PDL=on`` builds the executor; restored after."""
    settings = {"skinny_rows": skinny_rows, "prologue_rows": prologue_rows}
    changed = [(m, name, getattr(m, name), value) for name, value in settings.items() if value is not None
               for m in ex.model.modules() if hasattr(m, name)]
    reduce_was = getattr(ex.attention, "fuse_reduce", None)
    saved, pdl_was = ex.graphs, ex.pdl
    for m, name, _, value in changed:
        setattr(m, name, value)
    if fuse_reduce is not None:
        ex.attention.fuse_reduce = fuse_reduce
    if pdl is not None:
        ex.pdl = pdl
    ex.graphs = graphs
    try:
        yield
    finally:
        for m, name, was, _ in changed:
            setattr(m, name, was)
        if fuse_reduce is not None:
            ex.attention.fuse_reduce = reduce_was
        ex.graphs, ex.pdl = saved, pdl_was


def more_graphs(ex: InferExecutor) -> DecodeGraphs:
    """Another, empty set of decode graphs with the executor's ladder and width (captured lazily)."""
    g = ex.graphs
    settings = GraphSettings(g.backend.name, g.ladder, g.max_blocks * ex.block_size)
    return DecodeGraphs(settings, ex.device, ex.block_size, attention=ex.attention)


class Sequences:
    """``len(prompts)`` requests in the executor, each with blocks for ``room`` tokens past its prompt
    (blocks from 0 up: one ``Sequences`` at a time per executor; ``release`` before the next)."""

    def __init__(self, ex: InferExecutor, prompts: list[list[int]], room: int):
        self.ex, self.prompts = ex, prompts
        per_seq = blocks_for(max(map(len, prompts)) + room)
        self.tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
        self.lengths = [len(p) for p in prompts]  # tokens in the KV cache
        self.capacity = per_seq * BLOCK_SIZE  # tokens a sequence's blocks hold
        self.last: list[int] = []
        self._step = 0

    def _run(self, cmd: StepCommand) -> tuple[float, list[int]]:
        synchronize(self.ex.device)
        t = time.perf_counter()
        res = self.ex.execute(cmd)
        synchronize(self.ex.device)
        return time.perf_counter() - t, list(res.tokens)

    def prefill(self, step_tokens: int | None = None) -> list[float]:
        """Seconds of each prefill step: every prompt at once, or whole prompts packed up to
        ``step_tokens`` tokens a step (the engine's ``max_num_batched_tokens``)."""
        groups: list[list[int]] = [[]]
        for i, p in enumerate(self.prompts):
            if groups[-1] and step_tokens is not None and \
                    sum(len(self.prompts[j]) for j in groups[-1]) + len(p) > step_tokens:
                groups.append([])
            groups[-1].append(i)
        secs, last = [], {}
        for group in groups:
            self._step += 1
            steps = [SeqStep(i, list(self.prompts[i]), 0, block_table=list(self.tables[i]), sampling=GREEDY)
                     for i in group]
            s, tokens = self._run(StepCommand(self._step, True, steps))
            secs.append(s)
            last.update(zip(group, tokens))
        self.last = [last[i] for i in range(len(self.prompts))]
        return secs

    def decode(self) -> float:
        """Seconds of one decode step of every sequence (each gains one token)."""
        if max(self.lengths) + 1 > self.capacity:
            raise RuntimeError(f"a decode step past the {self.capacity} tokens each sequence's blocks hold: "
                               "the part planned too little room")
        self._step += 1
        steps = [SeqStep(i, [tok], n) for i, (tok, n) in enumerate(zip(self.last, self.lengths))]
        s, self.last = self._run(StepCommand(self._step, False, steps))
        self.lengths = [n + 1 for n in self.lengths]
        return s

    def release(self) -> None:
        for i in range(len(self.prompts)):
            self.ex.seqs.pop(i, None)


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, min(vocab, 30000), (batch, length), generator=g).tolist()
