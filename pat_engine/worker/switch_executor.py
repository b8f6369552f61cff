"""SwitchExecutor: one rank's part of a live layout change (docs/switch.md).

Runs while every rank is paused at a step boundary:
  1. take the new layout's TP group from the pool (created once, then cached);
  2. reshard weights layer by layer, moving only rows this rank lacks, each new shard written into its
     parameter's own storage when it fits there (``into_own_storage``: one address per parameter);
  3. KV: migrate the valid tokens of unfinished sequences layer by layer into
     a pool sized for the new layout, or drop the pool for recompute (each layer re-viewed in its memory);
  4. hand the executor its new group, pool and block tables (``InferExecutor.install``);
  5. restore the decode graphs this rank kept for the new layout if it was there before (they were set
     aside at step 1), and capture those its new DP group can still use that it lacks (worker/graph_capture.py);
and reports (``SwitchReport``) the time of each part, bytes sent and the peak extra memory.

Peak extra memory is counted explicitly: the new shards of one layer while
the old ones are alive, plus packed send/receive buffers. A KV layer is re-viewed in
the old one's memory, or freed before the new one is allocated, so migration never holds two pools.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from pat_engine.parallel.group_pool import CommGroupPool
from pat_engine.parallel.kv_plan import kv_heads_of, plan_kv_moves, token_slots
from pat_engine.parallel.layout import Layout
from pat_engine.parallel.p2p import exchange
from pat_engine.parallel.reshard_plan import allgather_bytes, plan_moves
from pat_engine.protocol import SwitchPlan, SwitchReport
from pat_engine.worker.device_memory import storage_view
from pat_engine.worker.infer_executor import InferExecutor
from pat_engine.worker.step_inputs import SeqState
from pat_engine.worker.kv_pool import PagedKVPool


class MemoryMeter:
    """Live and peak bytes of the temporary tensors a switch holds."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def add(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def sub(self, n: int) -> None:
        self.live -= n


def _settle(device: torch.device) -> None:
    """End a phase's clock once its device work is done: GPU kernels run asynchronously, and the next phase
    that waits for the device (graph capture synchronises) would otherwise be charged for them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def into_own_storage(old: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """``shard`` copied into ``old``'s storage from its first byte when it fits there, else ``shard`` itself.

    Each parameter owns its storage (model/layers: one allocation each), which therefore only grows: a switch
    to a higher TP writes the smaller shard where the larger one was, and the way back finds the room again.
    A parameter so keeps one address across layouts, which the decode graphs captured over a layout need to
    survive its leaving (worker/graph_capture.py), and a switch neither frees nor allocates weight memory
    (core/memory.py counts the base's bytes at every higher TP)."""
    kept = storage_view(old, tuple(shard.shape), shard.dtype)
    return shard if kept is None else kept.copy_(shard)


_LAYER_RE = re.compile(r"^layers\.(\d+)\.")


def params_by_layer(model: torch.nn.Module) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Parameters grouped into reshard units: embedding, each decoder layer, final norm + LM head."""
    groups: dict[object, list] = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=True):
        m = _LAYER_RE.match(name)
        key = int(m.group(1)) if m else ("head" if not name.startswith("embed") else "embed")
        groups[key].append((name, p))
    order = ["embed"] + sorted(k for k in groups if isinstance(k, int)) + ["head"]
    return [groups[k] for k in order if k in groups]


class SwitchExecutor:
    """One rank's switch. It owns no model state: it reshapes the executor's weights in place and
    hands the executor its new group, pool and tables through ``InferExecutor.install``."""

    def __init__(self, rank: int, cpu_world: object, groups: CommGroupPool) -> None:
        self.rank = rank
        self.cpu_world = cpu_world  # gloo group of every rank, for the pause/resume barriers
        self.groups = groups

    def run(self, plan: SwitchPlan, executor: InferExecutor) -> SwitchReport:
        meter = MemoryMeter()
        t0 = time.perf_counter()
        dist.barrier(group=self.cpu_world)  # every rank has paused
        graphs_left = executor.graphs.set_aside()  # kept for a return; none runs while the KV phase re-views the pool
        t = time.perf_counter()
        tp_group, hit = self.groups.get(plan.new)
        groups_s = time.perf_counter() - t

        t = time.perf_counter()
        with executor.writing_weights():  # the CPU GEMM packs are rebuilt inside, so their time counts here
            weight_sent, weight_local, allgather = self._reshard_weights(executor.model, plan.old, plan.new, meter)
        _settle(executor.device)
        weights_s = time.perf_counter() - t

        t = time.perf_counter()
        old_pool_bytes = executor.kv.nbytes
        if plan.kv_path == "migrate":
            pool, kv_sent = self._move_kv(plan, executor, meter)
        else:
            pool, kv_sent = executor.kv.regeometry(executor.arch.kv_heads_per_rank(plan.new.tp), plan.new_num_blocks), 0
        _settle(executor.device)
        kv_s = time.perf_counter() - t

        t = time.perf_counter()
        group = plan.new.group_of(self.rank)
        tables = {t.seq_id: SeqState(list(t.block_table), t.sampling, None if t.history is None else list(t.history))
                  for t in plan.tables if t.group == group}
        executor.install(plan.new, tp_group, pool, tables)
        rebuild_s = time.perf_counter() - t
        restored = executor.graphs.stats.restored
        graphs, graphs_s = executor.capture_graphs(plan.requests_in(group))  # the sizes this group can still run
        restored = executor.graphs.stats.restored - restored  # those the layout left here before, replayed again
        t = time.perf_counter()
        dist.barrier(group=self.cpu_world)  # nobody resumes before everyone is done
        rebuild_s += time.perf_counter() - t
        return SwitchReport.for_rank(
            self.rank, group_cache_hit=hit, groups_s=groups_s, weights_s=weights_s, kv_s=kv_s, rebuild_s=rebuild_s,
            graphs_s=graphs_s, graphs_captured=graphs, graphs_restored=restored, graphs_left=graphs_left,
            total_s=time.perf_counter() - t0, weight_bytes_sent=weight_sent, weight_bytes_local=weight_local,
            weight_bytes_allgather=allgather, kv_bytes_sent=kv_sent, peak_extra_bytes=meter.peak,
            kv_pool_bytes_before=old_pool_bytes, kv_pool_bytes_after=pool.nbytes)

    # ---- weights -------------------------------------------------------------------------------

    @torch.no_grad()
    def _reshard_weights(self, model, old: Layout, new: Layout, meter: MemoryMeter) -> tuple[int, int, int]:
        """Returns (bytes sent, bytes copied locally, bytes an all-gather-and-slice would have received)."""
        load: dict[int, int] = {}  # keeps senders balanced across parameters
        totals = (0, 0, 0)
        for index, params in enumerate(params_by_layer(model)):
            moved = self.reshard_unit(index, params, old, new, load, meter)
            totals = tuple(a + b for a, b in zip(totals, moved))
        return totals

    def reshard_unit(self, index: int, params: list[tuple[str, torch.nn.Parameter]], old: Layout, new: Layout,
                     load: dict[int, int], meter: MemoryMeter) -> tuple[int, int, int]:
        """Reshard one unit (``params_by_layer``'s ``index``-th) in place: (sent, local, all-gather) bytes."""
        me = self.rank
        sent = local = allgather = 0
        fresh: dict[str, torch.Tensor] = {}
        outgoing: dict[int, list[torch.Tensor]] = defaultdict(list)  # dst -> flattened row slices
        incoming: dict[int, list[torch.Tensor]] = defaultdict(list)  # src -> views of fresh to fill
        for name, p in params:
            spec = p.shard_spec
            if spec.replicated:
                continue
            dim = spec.split_dim
            row_bytes = _nbytes(p.data) // p.data.shape[dim]
            allgather += allgather_bytes(spec, old, new, row_bytes, dst=me)
            target = torch.zeros(spec.local_shape(new.tp), dtype=p.dtype, device=p.device)
            meter.add(_nbytes(target))
            fresh[name] = target
            for mv in plan_moves(spec, old, new, load):
                rows = mv.stop - mv.start
                if mv.dst == me and mv.src == me:
                    target.narrow(dim, mv.dst_local, rows).copy_(p.data.narrow(dim, mv.src_local, rows))
                    local += rows * row_bytes
                elif mv.src == me:
                    outgoing[mv.dst].append(p.data.narrow(dim, mv.src_local, rows).reshape(-1))
                elif mv.dst == me:
                    incoming[mv.src].append(target.narrow(dim, mv.dst_local, rows))
        # one packed message per peer and unit; both sides list pieces in plan order
        sends = {dst: torch.cat(parts) for dst, parts in outgoing.items()}
        recvs = {src: torch.empty(sum(v.numel() for v in views), dtype=views[0].dtype, device=views[0].device)
                 for src, views in incoming.items()}
        buffers = sum(_nbytes(b) for b in [*sends.values(), *recvs.values()])
        meter.add(buffers)
        exchange(sends, recvs, self.groups.p2p_path)
        sent += sum(_nbytes(b) for b in sends.values())
        for src, views in incoming.items():
            offset = 0
            for view in views:
                view.copy_(recvs[src][offset : offset + view.numel()].view(view.shape))
                offset += view.numel()
        meter.sub(buffers)
        for name, p in params:
            if name in fresh:
                p.data = into_own_storage(p.data, fresh[name])
                meter.sub(_nbytes(p.data))  # the fresh shard is freed here (or the old one, when it did not fit)
        return sent, local, allgather

    # ---- KV ------------------------------------------------------------------------------------

    @torch.no_grad()
    def _move_kv(self, plan: SwitchPlan, executor: InferExecutor, meter: MemoryMeter) -> tuple[PagedKVPool, int]:
        """Migrate the runs' valid tokens into a pool for the new layout; returns (pool, bytes sent)."""
        arch, me, bs = executor.arch, self.rank, executor.block_size
        moves = plan_kv_moves(list(plan.runs), plan.old, plan.new, arch.num_kv_heads)
        old_heads = kv_heads_of(plan.old.tp_rank(me), plan.old.tp, arch.num_kv_heads)
        new_heads = kv_heads_of(plan.new.tp_rank(me), plan.new.tp, arch.num_kv_heads)
        old_pool = executor.kv
        new_pool = executor.new_pool(plan.new, plan.new_num_blocks, filled_later=True)
        sent = 0
        src_slots = {i: torch.tensor(token_slots(p.src_table, p.num_tokens, bs)) for i, p in enumerate(plan.runs)}
        dst_slots = {i: torch.tensor(token_slots(p.dst_table, p.num_tokens, bs)) for i, p in enumerate(plan.runs)}
        outgoing = [m for m in moves if m.src == me]
        incoming = [m for m in moves if m.dst == me]
        for layer in range(arch.num_layers):
            old_layer = old_pool.layers[layer]  # (2, blocks, bs, kvh_old, hd)
            flat = old_layer.view(2, -1, old_layer.shape[-2], old_layer.shape[-1])  # (2, slots, kvh, hd)
            packed: dict[int, list[torch.Tensor]] = defaultdict(list)
            for m in outgoing:
                heads = [h - old_heads.start for h in m.heads]
                packed[m.dst].append(flat[:, src_slots[m.run]][:, :, heads].reshape(-1))  # (2, n, h, hd) flattened
            bufs = {d: torch.cat(parts) for d, parts in packed.items()}
            local = bufs.pop(me, None)
            recvs = {}
            for m in incoming:
                if m.src != me:
                    n = 2 * plan.runs[m.run].num_tokens * len(m.heads) * arch.head_dim
                    recvs[m.src] = recvs.get(m.src, 0) + n
            recvs = {s: torch.empty(n, dtype=old_layer.dtype, device=old_layer.device) for s, n in recvs.items()}
            live = sum(_nbytes(b) for b in list(bufs.values()) + list(recvs.values())) + (_nbytes(local) if local is not None else 0)
            meter.add(live)
            del flat, old_layer  # packed: the old layer's memory becomes the new layer (the pool's is the last reference)
            exchange(bufs, recvs, self.groups.p2p_path)
            sent += sum(_nbytes(b) for b in bufs.values())
            new_layer = new_pool.append_layer_from(old_pool, layer)
            new_flat = new_layer.view(2, -1, new_layer.shape[-2], new_layer.shape[-1])
            offsets: dict[int, int] = defaultdict(int)
            for m in incoming:
                buf = local if m.src == me else recvs[m.src]
                n_tok = plan.runs[m.run].num_tokens
                n = 2 * n_tok * len(m.heads) * arch.head_dim
                chunk = buf[offsets[m.src] : offsets[m.src] + n].view(2, n_tok, len(m.heads), arch.head_dim)
                offsets[m.src] += n
                heads = [h - new_heads.start for h in m.heads]
                idx = dst_slots[m.run]
                for j, h in enumerate(heads):
                    new_flat[:, idx, h] = chunk[:, :, j]
            meter.sub(live)
        return new_pool, sent

