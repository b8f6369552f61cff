"""``--emulate-world N``: profile an N-device deployment on one device.

For each TP degree T, one process builds TP rank 0's shard of the real model
(weights read from the checkpoint) and runs the grid's dummy batches through
it with a TP handle of size T whose collectives return local data. The
measured compute is then charged the collectives it skipped, from a stated
model (ring algorithms, per-rank link bandwidth B and per-hop latency a):

    all-reduce of n bytes over T ranks: 2(T-1)*a + 2(T-1)/T * n / B
    gather to rank 0 of n bytes each:   (T-1)*a + (T-1) * n / B

per forward: one all-reduce after the vocab-parallel embedding and two per
layer (attention output, MLP down projection) of tokens*hidden elements,
and one gather of the logits rows (vocab/T columns each).

The shard runs what the engine's worker runs (``worker/worker.py``): the
config's numerics and attention backend ("auto": the Triton kernels on a
GPU), and its decode graphs (``GraphSettings.from_config``: CUDA graphs on a
GPU, none on the CPU unless ``graph_backend="standin"``; ``enforce_eager``
turns them off), captured after the load for every ladder size up to the
largest batch profiled, so no point's window pays a capture. A point's
decode step is the MEDIAN of its window (a stray slow step, e.g. a Python
collection, moves a mean, not a median); the per-size capture seconds go
into the switch costs (``graphs_s_per_size``), as a real profile's do.

Not captured: contention between DP replicas on a shared host, the driver's
scheduling and IPC per step (only the worker's ``execute`` is timed: input
preparation, the forward or graph replay, the LM head and sampling), and
real collective behaviour (overlap, NCCL protocol switches). The table is
marked ``emulated`` with the model's constants, and ``meta["graphs"]`` says
which graphs ran and how often each shard replayed them.

The predictor's GPU error: fit ``LatencyPredictor`` to an emulated table and
compare its ``step_seconds(1, batch, total_tokens)`` with the real engine's
median decode steps at the same batch and context on the same device
(``bench/gpu_check.py --only decode profile`` sets them side by side); the
TP>1 points need a real multi-GPU engine to compare with (a real
``pat-profile`` run, or the engine's ``record_steps``), which also measures
the ring model's error.
"""

from __future__ import annotations

import datetime
import gc
import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from pat_engine.config import EngineConfig
from pat_engine.model.arch import ModelArch, load_model_arch
from pat_engine.parallel.comm import TPGroup
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.deployment import make_deployment, model_shape, reshard_bytes
from pat_engine.predictor.table import ProfilePoint, ProfileTable, SwitchCost
from pat_engine.protocol import SeqStep, StepCommand
from pat_engine.sampling.spec import SamplingSpec
from pat_profiler.draws import DRAWS
from pat_engine.worker.graph_capture import GraphSettings
from pat_engine.worker.infer_executor import InferExecutor
from pat_profiler.grid import GridPoint


class EmulatedTPGroup(TPGroup):
    """TP rank 0 of a group of ``size`` ranks that are not there: every collective returns local data."""

    def __init__(self, size: int):
        super().__init__(rank=0, size=size, ranks=tuple(range(size)))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat([x] * self.size, dim=dim)  # right shape, our data in every slot

    def gather_to_leader(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat([x] * self.size, dim=dim)

    def barrier(self) -> None:
        pass


@dataclass(frozen=True)
class CollectiveModel:
    link_bandwidth: float  # bytes/s per rank, one way
    latency_s: float  # per ring hop

    def all_reduce_s(self, nbytes: float, tp: int) -> float:
        if tp == 1:
            return 0.0
        return 2 * (tp - 1) * self.latency_s + 2 * (tp - 1) / tp * nbytes / self.link_bandwidth

    def gather_s(self, nbytes_each: float, tp: int) -> float:
        if tp == 1:
            return 0.0
        return (tp - 1) * self.latency_s + (tp - 1) * nbytes_each / self.link_bandwidth

    def forward_s(self, arch: ModelArch, tp: int, tokens: int, rows: int, elt: int) -> float:
        """Collective seconds of one forward with ``tokens`` input tokens and ``rows`` sampled rows."""
        act = tokens * arch.hidden_size * elt
        logits = rows * -(-arch.vocab_size // tp) * elt
        return (2 * arch.num_layers + 1) * self.all_reduce_s(act, tp) + self.gather_s(logits, tp)


class ShardRunner:
    """One emulated TP rank-0 shard with a paged pool big enough for the largest point, built as the
    engine's worker builds its executor from ``cfg`` (numerics, attention backend, decode graphs)."""

    def __init__(self, model_path: str, arch: ModelArch, tp: int, cfg: EngineConfig, device: torch.device,
                 num_blocks: int):
        layout = Layout.for_world(cfg.world, tp)
        self.ex = InferExecutor(arch, layout, EmulatedTPGroup(tp), cfg.torch_dtype(), device, cfg.block_size,
                                num_blocks, numerics=cfg.numerics, attention=cfg.attention_backend,
                                graphs=GraphSettings.from_config(cfg, arch))
        self.ex.load_weights(model_path)
        self.block_size, self.device = cfg.block_size, device
        self.step_id = 0

    def capture_graphs(self, upto: int) -> None:
        """Every decode graph a batch of at most ``upto`` rows can replay (nothing when graphs are off)."""
        self.ex.capture_graphs(upto)
        self._sync()

    def graph_stats(self) -> dict:
        return self.ex.graphs.stats.to_dict()

    def _run(self, cmd: StepCommand) -> tuple[float, list[int]]:
        self._sync()
        t = time.perf_counter()
        res = self.ex.execute(cmd)
        self._sync()
        return time.perf_counter() - t, res.tokens

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def point(self, prompts: list[list[int]], window: int, draw: str = "greedy"
              ) -> tuple[float, list[float], list[int]]:
        """Prefill seconds, decode step seconds, and total context per decode step (each step drawing as
        ``draw`` says: pat_profiler/draws.py)."""
        bs = self.block_size
        how = DRAWS[draw]
        spec = SamplingSpec(temperature=how.temperature, top_k=-1, top_p=1.0, seed=0, logprobs=how.logprobs)
        steps, next_block = [], 0
        for i, p in enumerate(prompts):
            need = -(-(len(p) + window + 1) // bs)
            steps.append(SeqStep(i, list(p), 0, block_table=list(range(next_block, next_block + need)), sampling=spec))
            next_block += need
        self.step_id += 1
        prefill_s, tokens = self._run(StepCommand(self.step_id, True, steps))
        lengths = [len(p) + 1 for p in prompts]
        decode_s, totals = [], []
        for _ in range(window):
            self.step_id += 1
            cmd = StepCommand(self.step_id, False, [SeqStep(i, [tokens[i]], lengths[i] - 1) for i in range(len(prompts))])
            s, tokens = self._run(cmd)
            decode_s.append(s)
            totals.append(sum(lengths))
            lengths = [n + 1 for n in lengths]
        self.ex.seqs.clear()  # the next point reuses the same blocks with fresh tables
        return prefill_s, decode_s, totals


def decode_step_seconds(window_s: list[float], collectives_s: float) -> tuple[float, float]:
    """A point's (decode step, its spread): the median step of the window plus the modelled collectives,
    and the window's population standard deviation."""
    return statistics.median(window_s) + collectives_s, statistics.pstdev(window_s)


def emulate_profile(model: str, world: int, tps: list[int] | None, dtype: str, device: str, grid: list[GridPoint],
                    window: int, collectives: CollectiveModel, block_size: int = 16, seed: int = 0,
                    progress=None, graph_backend: str = "auto", enforce_eager: bool = False,
                    draw: str = "greedy") -> ProfileTable:
    """The emulated table; ``graph_backend`` and ``enforce_eager`` as ``EngineConfig`` takes them (the
    defaults: what the engine runs on ``device``); ``draw``: how each decode step samples (draws.py)."""
    started = time.perf_counter()
    arch = load_model_arch(model)
    cfg = EngineConfig(model=model, tp=1, dp=world, dtype=dtype, device=device, block_size=block_size,
                       graph_backend=graph_backend, enforce_eager=enforce_eager)
    torch_dtype = cfg.torch_dtype()
    dev = torch.device("cuda" if device == "cuda" else "cpu")
    tps = sorted(tps or (layout.tp for layout in arch.valid_layouts(world)))
    elt = torch.empty((), dtype=torch_dtype).element_size()
    deployment = make_deployment(arch, model, torch_dtype, device, world, block_size, cfg.worker_threads(), tps,
                                 emulated=True, collective_model={"kind": "ring", **asdict(collectives)})
    table = ProfileTable(deployment, model_shape(arch, torch_dtype), bandwidth_bytes_per_s=collectives.link_bandwidth,
                         meta={"created": datetime.datetime.now().isoformat(timespec="seconds"), "window": window,
                               "draw": draw,
                               "emulated": "one device; collectives from the stated ring model"})
    rng = random.Random(seed)
    graphs: dict[str, dict] = {}  # per TP: the shard's graph stats after its points
    for tp in tps:
        pts = [p for p in grid if p.tp == tp]
        if not pts:
            continue
        blocks = max(p.batch * -(-(p.context + window + 1) // block_size) for p in pts)
        runner = ShardRunner(model, arch, tp, cfg, dev, blocks)
        runner.capture_graphs(max(p.batch for p in pts))
        runner.point([[5] * 8], 4, draw)  # warm-up
        for p in pts:
            prompts = [[rng.randrange(16, arch.vocab_size - 1) for _ in range(p.context)] for _ in range(p.batch)]
            prefill_s, decode_s, totals = runner.point(prompts, window, draw)
            comm_decode = collectives.forward_s(arch, tp, p.batch, p.batch, elt)
            comm_prefill = collectives.forward_s(arch, tp, p.batch * p.context, p.batch, elt)
            step_s, std_s = decode_step_seconds(decode_s, comm_decode)
            table.add_point(ProfilePoint(tp, p.batch, p.context, statistics.fmean(totals), prefill_s + comm_prefill,
                                         step_s, std_s, len(decode_s)))
            if progress is not None:
                progress(p)
        graphs[str(tp)] = runner.graph_stats()
        del runner
        if dev.type == "cuda":  # the next shard's weights, pool and graphs need the memory now
            gc.collect()
            torch.cuda.empty_cache()
    table.meta["graphs"] = {"backend": cfg.graphs() or "off (eager)", "per_tp": graphs}
    # switches are not run here: weights go over the modelled link, fixed costs are unknown (0); a switch's
    # graphs phase recaptures on the target shard, at the per-size seconds measured there
    for a in tps:
        for b in tps:
            if a != b:
                wb = reshard_bytes(arch, torch_dtype, Layout.for_world(world, a), Layout.for_world(world, b))
                per_graph = graphs.get(str(b), {}).get("capture_s_per_size", 0.0)
                table.switch_costs.append(SwitchCost(a, b, 0.0, wb, graphs_s_per_size=per_graph))
    table.meta["profile_seconds"] = round(time.perf_counter() - started, 2)
    return table
