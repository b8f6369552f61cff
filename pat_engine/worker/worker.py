"""Worker process: one per rank. Joins the world, holds an InferExecutor and a
SwitchExecutor, and serves the driver's messages until told to stop.

Messages arrive on a pipe: ``StepCommand`` (hot path; only TP rank 0 answers; a step sent with
``hold`` is answered after the next message is read, see protocol/steps.py), ``AnswerHeld``
or a ``Call`` carrying a typed control call (every addressed rank answers with a ``Reply``;
``handle`` picks the handler by the call's type from the handler groups: ``layout_handlers``,
``weight_handlers``, ``memory_handlers``, ``profile_handlers``). Any exception is
reported with its traceback instead of killing the process, so the driver can
name the failing rank.
"""

from __future__ import annotations

import datetime
import importlib
import os
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from pat_engine.model.arch import load_model_arch
from pat_engine.model.footprint import weight_bytes_per_rank
from pat_engine.parallel.group_pool import CommGroupPool
from pat_engine.protocol import AnswerHeld, StepCommand, WorkerArgs
from pat_engine.protocol.calls import Call, Reply, Shutdown, WorkerCall
from pat_engine.worker.graph_capture import GraphSettings
from pat_engine.worker.device_memory import RankMemory
from pat_engine.worker.handlers import handler_table
from pat_engine.worker.infer_executor import InferExecutor, LaunchedStep
from pat_engine.worker.layout_handlers import LayoutHandlers
from pat_engine.worker.memory_handlers import MemoryHandlers
from pat_engine.worker.profile_handlers import ProfileHandlers
from pat_engine.worker.weight_handlers import WeightHandlers


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
        placement = args.placement  # parallel/devices.py: device, memory share, collective backend
        arch = load_model_arch(cfg.model)
        self.device, self.memory = torch.device("cpu"), None
        if cfg.device == "cuda":
            self.device = torch.device("cuda", placement.device_index(args.rank))
            torch.cuda.set_device(self.device)
            weights = weight_bytes_per_rank(arch, args.layout.tp, cfg.torch_dtype())
            self.memory = RankMemory.at_start(cfg, placement, args.rank, self.device, weights)
        backend = placement.device_backend
        timeout = datetime.timedelta(seconds=cfg.collective_timeout_s)
        store = dist.TCPStore(args.store_host, args.store_port, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=args.rank, world_size=args.world, timeout=timeout)
        # control group for CPU objects when the device backend is NCCL
        self.cpu_world = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        self.groups = CommGroupPool(args.rank, args.world, backend, timeout, host_staged=placement.host_staged,
                                    device=self.device)
        tp_group, _ = self.groups.get(args.layout)
        self.executor = InferExecutor(arch, args.layout, tp_group, cfg.torch_dtype(), self.device,
                                      cfg.block_size, args.num_blocks, lazy_kv=cfg.kv_cache_bytes is None,
                                      numerics=cfg.numerics, attention=cfg.attention_backend,
                                      graphs=GraphSettings.from_config(cfg, arch), max_tp=cfg.max_tp)
        self.executor.load_weights(args.weights_path)
        if args.num_blocks > 0:  # on a GPU sized from free memory the pool comes later (AllocateKV)
            self.executor.capture_graphs()
        self.layout_calls = LayoutHandlers(args.rank, args.world, self.cpu_world, self.groups, self.executor)
        self.weight_calls = WeightHandlers(args.rank, self.executor)
        self.memory_calls = MemoryHandlers(cfg, self.executor, self.memory)
        self.profile_calls = ProfileHandlers(args.rank, self.device)
        # call type -> handler, from the handlers' annotations (worker/handlers.py)
        self.handlers = handler_table(self, self.layout_calls, self.weight_calls, self.memory_calls,
                                      self.profile_calls)

    def handle(self, call: WorkerCall) -> Any:
        handler = self.handlers.get(type(call))
        if handler is None:
            raise TypeError(f"no handler for the control call {type(call).__name__}")
        return handler(call)

    def shutdown(self, call: Shutdown) -> None:
        self.groups.close()
        return None  # answered; ``serve`` then returns

    def step(self, cmd: StepCommand) -> LaunchedStep | None:
        """The hot path: launch one step of this rank's group (TP rank 0 gets the step to answer)."""
        return self.executor.launch(cmd)

    # ---- loop ----------------------------------------------------------------------------

    def serve(self, conn) -> None:
        held: LaunchedStep | None = None  # a step launched with ``hold``, answered at the next message
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return  # driver went away
            except Exception as exc:  # could not unpickle: say so rather than die silently
                conn.send(Reply(-1, self.rank, False, error=traceback.format_exc(), error_type=type(exc).__name__))
                continue
            if held is not None and not (isinstance(msg, StepCommand) and msg.follows == held.cmd.step_id):
                self._answer(conn, held)  # nothing follows it: answer before anything else runs
                held = None
            if isinstance(msg, AnswerHeld):
                continue
            if isinstance(msg, StepCommand):
                held = self._run_step(conn, msg, held)
                continue
            assert isinstance(msg, Call), f"unexpected message {type(msg).__name__}"
            try:
                value = self.handle(msg.body)
                conn.send(Reply(msg.call_id, self.rank, True, value=value))
            except Exception as exc:
                conn.send(Reply(msg.call_id, self.rank, False, error=traceback.format_exc(), error_type=type(exc).__name__))
            if isinstance(msg.body, Shutdown):
                return

    def _run_step(self, conn, cmd: StepCommand, held: LaunchedStep | None) -> LaunchedStep | None:
        """Launch ``cmd``, then answer the step it follows (held until now, so the device runs the two
        back to back); ``cmd`` itself is answered now or, sent with ``hold``, kept for the next message."""
        try:
            launched = self.step(cmd)
        except Exception:
            conn.send(Reply(-cmd.step_id, self.rank, False, error=traceback.format_exc()))
            return None
        self.profile_calls.step_launched()
        if held is not None:
            self._answer(conn, held)
        if launched is None or cmd.hold:
            return launched
        self._answer(conn, launched)
        return None

    def _answer(self, conn, launched: LaunchedStep) -> None:
        try:
            conn.send(launched.answer())
        except Exception:
            conn.send(Reply(-launched.cmd.step_id, self.rank, False, error=traceback.format_exc()))


def worker_class(path: str | None) -> type[Worker]:
    """The ``Worker`` subclass ``path`` names ("module:Class"; tests inject faults through one), else ``Worker``."""
    if path is None:
        return Worker
    module, _, name = path.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise TypeError(f"worker_class {path!r} is not a Worker subclass")
    return cls


def worker_main(conn) -> None:
    import multiprocessing

    multiprocessing.current_process().authkey = conn.recv_bytes()
    args: WorkerArgs = conn.recv()
    threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    try:
        worker = worker_class(args.config.worker_class)(args)
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

