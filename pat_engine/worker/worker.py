"""Worker process: one per rank. Joins the world, holds an InferExecutor and a
SwitchExecutor, and serves the driver's messages until told to stop.

Messages arrive on a pipe: ``StepCommand`` (hot path; only TP rank 0 answers)
or ``Call`` (every addressed rank answers with a ``Reply``). Any exception is
reported with its traceback instead of killing the process, so the driver can
name the failing rank.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import traceback

import torch
import torch.distributed as dist

from pat_engine.model.arch import load_model_arch
from pat_engine.parallel.group_pool import CommGroupPool
from pat_engine.protocol import Call, Reply, StepCommand, SwitchPlan, SwitchReport, WorkerArgs
from pat_engine.worker.faults import FaultInjector
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
                                      cfg.block_size, args.num_blocks, lazy_kv=cfg.kv_cache_bytes is None)
        self.executor.load_weights(args.weights_path)
        self.faults = FaultInjector(args.rank)
        self.switcher = SwitchExecutor(args.rank, self.cpu_world, self.groups, self.faults)
        self.update_groups: dict[str, dist.ProcessGroup] = {}  # trainer weight-update groups, by name

    # ---- RPC methods (called by name from the driver) -----------------------------------

    def rpc_switch(self, plan: SwitchPlan) -> SwitchReport:
        return self.switcher.run(plan, self.executor)

    def rpc_stats(self) -> dict:
        s = self.groups.stats
        return {"group_hits": s.hits, "group_misses": s.misses, "group_seconds": s.creation_seconds,
                "layouts": list(s.created_layouts), "kv_blocks": self.executor.kv.num_blocks}

    def rpc_bandwidth_probe(self, nbytes: int, repeats: int = 3) -> float:
        """Best time (s) to send ``nbytes`` to the next rank while receiving as many from the previous.

        Every rank sends and receives at once, the pattern of a KV or weight redistribution.
        """
        from pat_engine.parallel.p2p import exchange

        world = self.args.world
        if world == 1:
            return 0.0
        out = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=self.device)
        inp = torch.empty_like(out)
        best = float("inf")
        for _ in range(repeats):
            dist.barrier(group=self.cpu_world)
            t = time.perf_counter()
            exchange({(self.rank + 1) % world: out}, {(self.rank - 1) % world: inp})
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return best

    def rpc_inject_fault(self, where: str, how: str = "raise") -> None:
        """Test hook: make the next pass through ``where`` raise, hang, or kill this process."""
        self.faults.arm(where, how)

    # ---- weights and memory (RL colocation) -----------------------------------------------

    def rpc_load_weights(self, tensors: list) -> int:
        """Load full HF-named tensors into this rank's shards under the current layout."""
        return self.executor.load_tensors(tensors)

    def rpc_init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                      world_size: int, group_name: str, backend: str, timeout_s: float) -> None:
        """Join a trainer's weight-update group as rank ``rank_offset + self.rank``."""
        from pat_engine.parallel.update_group import join_update_group

        if group_name in self.update_groups:
            raise ValueError(f"weight-update group {group_name!r} already exists; destroy it first")
        self.update_groups[group_name] = join_update_group(master_address, master_port, rank_offset + self.rank,
                                                           world_size, group_name, backend, timeout_s)

    def rpc_update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                            group_name: str) -> int:
        """Receive the trainer's broadcast of full tensors and load this rank's shards of them."""
        from pat_engine.parallel.update_group import receive_broadcast

        tensors = receive_broadcast(self.update_groups[group_name], names, dtypes, shapes, self.device)
        return self.executor.load_tensors(tensors)

    def rpc_destroy_weights_update_group(self, group_name: str) -> bool:
        pg = self.update_groups.pop(group_name, None)
        if pg is not None:
            dist.destroy_process_group(pg)
        return pg is not None

    def rpc_reload_weights(self, path: str) -> None:
        self.executor.load_weights(path)

    def rpc_release_memory(self, kv: bool, weights: str | None) -> int:
        """Free the KV pool and/or the weights ("offloaded" to host, or "discarded"); bytes freed."""
        return self.executor.release_memory(kv, weights)

    def rpc_restore_memory(self, kv_blocks: int | None, weights: bool) -> None:
        self.executor.restore_memory(kv_blocks, weights)

    def rpc_allocate_kv(self, num_blocks: int) -> None:
        """GPU start-up: the first KV pool, once the driver knows what every rank can hold."""
        self.executor.allocate_kv(num_blocks)

    def rpc_kv_budget(self, utilization: float) -> int:
        """GPU: bytes this rank can give the KV pool, after weights and an activation reserve."""
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        arch, cfg = self.executor.arch, self.args.config
        tp = self.executor.tp.size
        elt = torch.empty((), dtype=self.executor.dtype).element_size()
        # activations of the largest prefill step, plus full-vocab logits of a decode batch (float32)
        reserve = cfg.max_num_batched_tokens * (4 * arch.hidden_size + 2 * arch.intermediate_size // tp) * elt
        reserve += cfg.max_num_seqs * arch.vocab_size * 4
        return max(0, int(free - total * (1 - utilization) - reserve))

    def rpc_shutdown(self) -> None:
        return None

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
                value = getattr(self, f"rpc_{msg.method}")(**msg.kwargs)
                conn.send(Reply(msg.call_id, self.rank, True, value=value))
            except Exception as exc:
                conn.send(Reply(msg.call_id, self.rank, False, error=traceback.format_exc(), error_type=type(exc).__name__))
            if msg.method == "shutdown":
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

