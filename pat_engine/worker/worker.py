"""Worker process: one per rank. Joins the world, holds an InferExecutor and a
SwitchExecutor, and serves the driver's messages until told to stop.

Messages arrive on a pipe: ``StepCommand`` (hot path; only TP rank 0 answers)
or a ``Call`` carrying a typed control call (every addressed rank answers with a ``Reply``;
``handle`` picks the handler by the call's type). Any exception is
reported with its traceback instead of killing the process, so the driver can
name the failing rank.
"""

from __future__ import annotations

import datetime
import functools
import os
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from pat_engine.model.arch import load_model_arch
from pat_engine.parallel.group_pool import CommGroupPool
from pat_engine.protocol import (
    AllocateKV, BandwidthProbe, Call, DestroyWeightsUpdateGroup, InitWeightsUpdateGroup, InjectFault, KVBudget,
    LoadWeights, LoadWeightsFromHandles, ReleaseMemory, ReloadWeights, Reply, RestoreMemory, Shutdown, Stats,
    StepCommand, Switch, SwitchReport, UpdateWeightsFromDistributed, WorkerArgs, WorkerCall,
)
from pat_engine.worker.faults import FaultInjector
from pat_engine.worker.graph_capture import GraphSettings
from pat_engine.worker.infer_executor import InferExecutor
from pat_engine.worker.switch_executor import SwitchExecutor


def _watch_parent(parent_pid: int) -> None:
    # If the driver dies without a shutdown, do not linger as an orphan.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


class Worker:
    def __init__(self, args: WorkerArgs):
        cfg = args.config
        self.args, self.rank = args, args.rank
        torch.set_num_threads(cfg.worker_threads())
        self.device = torch.device("cpu")
        backend = "gloo"
        if cfg.device == "cuda":
            local = args.rank % torch.cuda.device_count()
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
            backend = "nccl"
        timeout = datetime.timedelta(seconds=cfg.collective_timeout_s)
        store = dist.TCPStore(args.store_host, args.store_port, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=args.rank, world_size=args.world, timeout=timeout)
        # control group for CPU objects when the device backend is NCCL
        self.cpu_world = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        self.groups = CommGroupPool(args.rank, args.world, backend, timeout)
        tp_group, _ = self.groups.get(args.layout)
        arch = load_model_arch(cfg.model)
        self.executor = InferExecutor(arch, args.layout, tp_group, cfg.torch_dtype(), self.device,
                                      cfg.block_size, args.num_blocks, lazy_kv=cfg.kv_cache_bytes is None,
                                      numerics=cfg.numerics, attention=cfg.attention_backend,
                                      graphs=GraphSettings.from_config(cfg, arch.max_position), max_tp=cfg.max_tp)
        self.executor.load_weights(args.weights_path)
        if args.num_blocks > 0:  # on a GPU sized from free memory the pool comes later (AllocateKV)
            self.executor.capture_graphs()
        self.faults = FaultInjector(args.rank)
        self.switcher = SwitchExecutor(args.rank, self.cpu_world, self.groups, self.faults)
        self.update_groups: dict[str, dist.ProcessGroup] = {}  # trainer weight-update groups, by name

    # ---- control calls, picked by the call's type (protocol/calls.py) ---------------------------

    @functools.singledispatchmethod
    def handle(self, call: WorkerCall) -> Any:
        raise TypeError(f"no handler for the control call {type(call).__name__}")

    @handle.register
    def _switch(self, call: Switch) -> SwitchReport:
        return self.switcher.run(call.plan, self.executor)

    @handle.register
    def _stats(self, call: Stats) -> dict:
        s = self.groups.stats
        return {"group_hits": s.hits, "group_misses": s.misses, "group_seconds": s.creation_seconds,
                "layouts": list(s.created_layouts), "kv_blocks": self.executor.kv.num_blocks,
                "graphs": {"captured": list(self.executor.graphs.captured), **self.executor.graphs.stats.to_dict()}}

    @handle.register
    def _bandwidth_probe(self, call: BandwidthProbe) -> float:
        # every rank sends and receives at once, the pattern of a KV or weight redistribution
        from pat_engine.parallel.p2p import exchange

        world = self.args.world
        if world == 1:
            return 0.0
        out = torch.ones(max(1, call.nbytes // 4), dtype=torch.float32, device=self.device)
        inp = torch.empty_like(out)
        best = float("inf")
        for _ in range(call.repeats):
            dist.barrier(group=self.cpu_world)
            t = time.perf_counter()
            exchange({(self.rank + 1) % world: out}, {(self.rank - 1) % world: inp})
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return best

    @handle.register
    def _inject_fault(self, call: InjectFault) -> None:
        self.faults.arm(call.where, call.how)

    @handle.register
    def _shutdown(self, call: Shutdown) -> None:
        return None

    # ---- weights (RL weight sync) ----------------------------------------------------------------

    @handle.register
    def _load_weights(self, call: LoadWeights) -> int:
        return self.executor.load_tensors(call.tensors)

    @handle.register
    def _load_weights_from_handles(self, call: LoadWeightsFromHandles) -> int:
        from pat_engine.model.weights import WeightNameCheck
        from pat_engine.model.weight_handles import load_named_tensors

        tensors = load_named_tensors(call.payloads, self.rank, self.device)  # views of the trainer's memory
        check = WeightNameCheck(self.executor.model)
        for name, tensor in tensors:  # the whole bucket before any of it is applied
            check.check(name, tuple(tensor.shape))
        applied = self.executor.load_tensors(tensors)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the trainer may free or overwrite its tensors once we answer
        return applied

    @handle.register
    def _reload_weights(self, call: ReloadWeights) -> None:
        self.executor.load_weights(call.path)

    @handle.register
    def _init_weights_update_group(self, call: InitWeightsUpdateGroup) -> None:
        from pat_engine.parallel.update_group import STATELESS_NCCL, join_stateless_nccl, join_update_group

        if call.group_name in self.update_groups:
            raise ValueError(f"weight-update group {call.group_name!r} already exists; destroy it first")
        rank = call.rank_offset + self.rank
        if call.backend == STATELESS_NCCL:  # each worker receives on its own device
            group = join_stateless_nccl(call.master_address, call.master_port, rank, call.world_size, self.device)
        else:
            group = join_update_group(call.master_address, call.master_port, rank, call.world_size, call.group_name,
                                      call.backend, call.timeout_s)
        self.update_groups[call.group_name] = group

    @handle.register
    def _update_weights_from_distributed(self, call: UpdateWeightsFromDistributed) -> int:
        from pat_engine.parallel.update_group import receive_broadcast

        tensors = receive_broadcast(self.update_groups[call.group_name], call.names, call.dtypes, call.shapes,
                                    self.device)
        return self.executor.load_tensors(tensors)

    @handle.register
    def _destroy_weights_update_group(self, call: DestroyWeightsUpdateGroup) -> bool:
        pg = self.update_groups.pop(call.group_name, None)
        if isinstance(pg, dist.ProcessGroup):
            dist.destroy_process_group(pg)
        return pg is not None  # a PyNccl communicator is dropped with its last reference

    # ---- memory (RL colocation, GPU start-up) ----------------------------------------------------

    @handle.register
    def _release_memory(self, call: ReleaseMemory) -> int:
        return self.executor.release_memory(call.kv, call.weights)

    @handle.register
    def _restore_memory(self, call: RestoreMemory) -> None:
        self.executor.restore_memory(call.kv_blocks, call.weights)

    @handle.register
    def _allocate_kv(self, call: AllocateKV) -> None:
        self.executor.allocate_kv(call.num_blocks)
        self.executor.capture_graphs()

    @handle.register
    def _kv_budget(self, call: KVBudget) -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        arch, cfg = self.executor.arch, self.args.config
        tp = self.executor.tp.size
        elt = torch.empty((), dtype=self.executor.dtype).element_size()
        # activations of the largest prefill step, plus full-vocab logits of a decode batch (float32)
        reserve = cfg.max_num_batched_tokens * (4 * arch.hidden_size + 2 * arch.intermediate_size // tp) * elt
        reserve += cfg.max_num_seqs * arch.vocab_size * 4
        reserve += self.executor.graphs.reserve_bytes(arch.hidden_size, arch.intermediate_size // tp, elt)
        return max(0, int(free - total * (1 - call.utilization) - reserve))

    # ---- loop ----------------------------------------------------------------------------

    def serve(self, conn) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return  # driver went away
            except Exception as exc:  # could not unpickle: say so rather than die silently
                conn.send(Reply(-1, self.rank, False, error=traceback.format_exc(), error_type=type(exc).__name__))
                continue
            if isinstance(msg, StepCommand):
                try:
                    self.faults.check("step")
                    result = self.executor.execute(msg)
                    if result is not None:
                        conn.send(result)
                except Exception:
                    conn.send(Reply(-msg.step_id, self.rank, False, error=traceback.format_exc()))
                continue
            assert isinstance(msg, Call), f"unexpected message {type(msg).__name__}"
            try:
                value = self.handle(msg.body)
                conn.send(Reply(msg.call_id, self.rank, True, value=value))
            except Exception as exc:
                conn.send(Reply(msg.call_id, self.rank, False, error=traceback.format_exc(), error_type=type(exc).__name__))
            if isinstance(msg.body, Shutdown):
                return


def worker_main(conn) -> None:
    import multiprocessing

    multiprocessing.current_process().authkey = conn.recv_bytes()
    args: WorkerArgs = conn.recv()
    threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    try:
        worker = Worker(args)
    except Exception as exc:
        conn.send(Reply(0, args.rank, False, error=traceback.format_exc(), error_type=type(exc).__name__))
        return
    conn.send(Reply(0, args.rank, True, value={"pid": os.getpid()}))
    try:
        worker.serve(conn)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass

