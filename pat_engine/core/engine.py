"""``Engine``: the Python API of pat-engine.

    from pat_engine import Engine, SamplingParams
    with Engine("path/to/model", tp=1, dp=4, dtype="float64") as engine:
        outs = engine.generate(["a prompt", [1, 2, 3]], SamplingParams(max_new_tokens=64),
                               switch_schedule=[(32, 4)])  # go to TP4 at decode step 32

Every method can be called from any thread; the work runs in the engine loop.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterable, Iterator, Sequence as Seq

from tqdm.auto import tqdm

from pat_engine.config import EngineConfig
from pat_engine.core.block_allocator import blocks_needed
from pat_engine.core.coordinator import GlobalCoordinator, StepRecord
from pat_engine.core.inputs import RequestFactory, load_tokenizer
from pat_engine.core.loop import EngineLoop
from pat_engine.core.memory import CPU_DEFAULT_KV_BYTES, MemoryPlan
from pat_engine.core.policy import ScheduledSwitches, SwitchDecision, SwitchPolicy
from pat_engine.core.request import Sequence
from pat_engine.core.restart_budget import RestartBudget
from pat_engine.core.rl_control import RLControlMixin
from pat_engine.core.timeline import SwitchEvent
from pat_engine.core.worker_pool import WorkerPool
from pat_engine.errors import EngineDeadError, InvalidRequestError, LayoutError, ModelLoadError, WorkerFailure
from pat_engine.model.arch import load_model_arch
from pat_engine.model.weights import check_safetensors_headers, safetensors_files
from pat_engine.outputs import RequestOutput
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.setup import attach_controller
from pat_engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class RequestHandle:
    """A submitted request: wait for it, or watch it grow (streaming)."""

    def __init__(self, seq: Sequence, decode: Callable[[list[int]], str | None]):
        self.seq = seq
        self._decode = decode
        self._done = threading.Event()
        self._cond = threading.Condition()
        self._listeners: list[Callable[[Sequence, int], None]] = []
        seq.on_update = self._on_update

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    def add_listener(self, fn: Callable[[Sequence, int], None]) -> None:
        """``fn(seq, new_tokens)`` runs in the engine loop thread after every update."""
        self._listeners.append(fn)

    def _on_update(self, seq: Sequence, new_tokens: int) -> None:
        for fn in self._listeners:
            fn(seq, new_tokens)
        with self._cond:
            self._cond.notify_all()
        if seq.finished:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def output(self) -> RequestOutput:
        return self.seq.to_output(self._decode)

    def stream(self, poll_s: float = 0.5) -> Iterator[list[int]]:
        """Yield lists of newly generated token ids until the request finishes."""
        sent = 0
        while True:
            with self._cond:
                if len(self.seq.output_ids) == sent and not self.seq.finished:
                    self._cond.wait(poll_s)
            ids = self.seq.output_ids[sent:]
            if ids:
                sent += len(ids)
                yield ids
            if self.seq.finished and sent >= len(self.seq.output_ids):
                return


class Engine(RLControlMixin):
    def __init__(self, model: str, tp: int = 1, dp: int = 1, **kwargs: Any):
        self.config = EngineConfig.from_kwargs(model, tp=tp, dp=dp, **kwargs)
        cfg = self.config
        self.arch = load_model_arch(cfg.model)  # unknown architecture / missing files fail here, before spawning
        check_safetensors_headers(safetensors_files(cfg.model))  # a damaged file is named before spawning
        self.base_layout = self._check_layout(cfg.tp)
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
        max_len = min(cfg.max_model_len or self.arch.max_position, self.arch.max_position)
        self.requests = RequestFactory(self.arch, self.tokenizer, max_len, cfg.seed)
        dtype = cfg.torch_dtype()
        on_gpu = cfg.device == "cuda"
        if on_gpu:
            raise_if_no_cuda()
        measure = on_gpu and cfg.kv_cache_bytes is None  # GPU: size the KV pool from free memory
        kv_bytes = cfg.kv_cache_bytes or CPU_DEFAULT_KV_BYTES
        self.memory = MemoryPlan(self.arch, dtype, cfg.block_size, kv_bytes, self.base_layout, device_budget=on_gpu)
        pool = self._start_pool(kv_blocks=0 if measure else None)
        if measure:
            try:
                budgets = pool.call("kv_budget", utilization=cfg.gpu_memory_utilization)
                self.memory.kv_budget_base = min(budgets)  # every rank must hold the same pool
                pool.call("wake_up", kv_blocks=self.memory.num_blocks(self.base_layout), weights=False)
            except BaseException:
                pool.kill()
                raise
        if self.memory.num_blocks(self.base_layout) < 1:
            pool.kill()
            raise InvalidRequestError(f"the KV budget ({self.memory.kv_budget_base} bytes per rank) holds no KV block")
        self.coordinator = GlobalCoordinator(cfg, self.memory, pool, self.base_layout)
        self._loop = EngineLoop(self.coordinator, self._start_pool,
                                RestartBudget(cfg.max_worker_restarts, cfg.restart_window_s), cfg.recover_failed_workers)
        self._closed = False
        try:
            attach_controller(self)
        except BaseException:
            self.shutdown()
            raise

    def _start_pool(self, kv_blocks: int | None = None) -> WorkerPool:
        blocks = self.memory.num_blocks(self.base_layout) if kv_blocks is None else kv_blocks
        pool = WorkerPool(self.config, self.base_layout, blocks, self._weights_path)
        try:
            pool.start()
        except WorkerFailure as exc:
            if exc.error_type == "ModelLoadError":  # a bad checkpoint, found while loading shards
                raise ModelLoadError(str(exc).splitlines()[0]) from None
            raise
        return pool

    def _check_layout(self, tp: int) -> Layout:
        layout = Layout.for_world(self.config.world, tp)
        try:
            self.arch.check_tp(tp)
        except ValueError as exc:
            raise LayoutError(str(exc)) from None
        return layout

    # ---- context manager / lifecycle ------------------------------------------------------------

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._loop.stop()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

    # ---- state ---------------------------------------------------------------------------------

    @property
    def layout(self) -> Layout:
        return self.coordinator.layout

    @property
    def timeline(self) -> dict:
        return self.coordinator.timeline.to_dict()

    @property
    def switches(self) -> list[SwitchEvent]:
        return list(self.coordinator.timeline.switches)

    @contextlib.contextmanager
    def record_steps(self) -> Iterator[list[StepRecord]]:
        """Collect a ``StepRecord`` for every step run inside the ``with`` block."""
        log: list[StepRecord] = []
        self._loop.run(lambda: setattr(self.coordinator, "step_log", log))
        try:
            yield log
        finally:
            self._loop.run(lambda: setattr(self.coordinator, "step_log", None))

    def measure_bandwidth(self, nbytes: int = 8 << 20, repeats: int = 3) -> float:
        """One-way per-rank point-to-point bandwidth (bytes/s), every rank sending at once."""
        seconds = self._loop.run(lambda: self.coordinator.pool.call("bandwidth_probe", nbytes=nbytes, repeats=repeats))
        slowest = max(seconds)
        return float("inf") if slowest == 0 else nbytes / slowest

    def kv_blocks(self) -> dict:
        """Free and total KV blocks per DP group and the number of unfinished requests (run in the loop).

        Runs the coordinator's own invariant check (free + used == total, no block owned twice)
        when it has one, and reports its error instead of raising."""

        def read() -> dict:
            coord = self.coordinator
            groups = [{"group": g, "free": s.allocator.num_free, "total": s.allocator.num_blocks}
                      for g, s in enumerate(coord.schedulers)]
            out = {"layout": str(coord.layout), "groups": groups, "unfinished": len(coord.unfinished()),
                   "invariants": "not available"}
            check = getattr(coord, "check_block_invariants", None)
            if check is not None:
                try:
                    check()
                    out["invariants"] = "ok"
                except Exception as exc:  # reported, not raised: this is a diagnostic
                    out["invariants"] = f"violated: {exc}"
            return out

        return self._loop.run(read)

    def worker_stats(self) -> list[dict]:
        return self._loop.run(lambda: self.coordinator.pool.call("stats"))

    # ---- requests --------------------------------------------------------------------------------

    def _make(self, prompts: Seq[Any], params: SamplingParams | Seq[SamplingParams] | None,
              request_ids: Seq[str] | None) -> list[Sequence]:
        if self._sleep_level:
            raise InvalidRequestError("the engine is asleep; call wake_up() before generating")
        if self._loop.stale_weights:
            raise InvalidRequestError(
                "the served weights are not current (workers restarted after a failure, or woken from a level-2 "
                "sleep, after in-memory weight updates); call update_weights() or update_weights_from_disk() first")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        if request_ids is not None and len(request_ids) != len(prompts):
            raise InvalidRequestError(f"got {len(prompts)} prompts but {len(request_ids)} request ids")
        seqs = [
            self.requests.make(p, sp, request_ids[i] if request_ids else None, where=f"prompt {i}")
            for i, (p, sp) in enumerate(zip(prompts, params))
        ]
        capacity = self.memory.tokens_per_group(self.layout)
        for i, seq in enumerate(seqs):
            need = blocks_needed(len(seq.prompt_ids) + seq.params.max_new_tokens, self.config.block_size) * self.config.block_size
            if need > capacity:
                raise InvalidRequestError(
                    f"prompt {i}: needs {need} KV token slots but a DP group holds {capacity}; "
                    "lower max_new_tokens or raise kv_cache_bytes"
                )
        return seqs

    def submit(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None) -> RequestHandle:
        """Queue one request and return at once (used by the server and streaming)."""
        self._ensure_open()
        seq = self._make([prompt], params, [request_id] if request_id else None)[0]
        handle = RequestHandle(seq, self.requests.decode)
        self._loop.run(self._loop.admit, [seq])
        return handle

    def abort(self, request_ids: Iterable[str]) -> int:
        """Stop requests; they finish with reason "abort" and keep what they generated."""
        wanted = set(request_ids)

        def _abort() -> int:
            ids = [s.seq_id for s in self.coordinator.unfinished() if s.request_id in wanted]
            held = [s for s in self._loop.quarantine.parked() if s.request_id in wanted and not s.finished]
            self._loop.finish_parked(held, "abort", "aborted by the caller")  # held back after a crash
            return len(self.coordinator.abort(ids, "abort", "aborted by the caller")) + len(held)

        return self._loop.run(_abort)

    def generate(
        self,
        prompts: Seq[Any] | str,
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        switch_schedule: list[tuple[int, int]] | None = None,
        kv_transfer: str | None = None,
        policy: SwitchPolicy | None = None,
        from_base_layout: bool = False,
        request_ids: Seq[str] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order.

        ``switch_schedule``: ``[(decode_step, tp), ...]``, switch when the batch reaches each step;
        ``kv_transfer`` forces "migrate" or "recompute" for those switches (default: the cost model).
        ``policy``: any ``SwitchPolicy`` (e.g. the predictor-driven controller) for this batch.
        ``from_base_layout``: return to the engine's base layout first (a new RL generation stage).
        """
        self._ensure_open()
        seqs = self._make(prompts, params, request_ids)
        start_stage = self._stage_starter(switch_schedule, kv_transfer, policy, from_base_layout)
        handles = [RequestHandle(s, self.requests.decode) for s in seqs]
        bar = tqdm(total=len(seqs), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)

        def start() -> None:
            if self._loop.dead is not None:
                raise EngineDeadError(self._loop.dead)
            start_stage()
            self._loop.admit(seqs)

        self._loop.run(start)
        try:
            finished = 0
            while finished < len(handles):
                handles[finished].wait(0.2)
                done = sum(h.done() for h in handles)
                if done != bar.n:
                    bar.update(done - bar.n)
                    bar.set_postfix_str(str(self.coordinator.layout), refresh=False)
                while finished < len(handles) and handles[finished].done():
                    finished += 1
                if self._loop.dead and finished < len(handles):
                    raise WorkerFailure(self._loop.dead, partial_outputs=[h.output() for h in handles])
        finally:
            bar.close()
        outputs = [h.output() for h in handles]
        errors = [o for o in outputs if o.finish_reason == "error"]
        if errors:
            raise WorkerFailure(f"{len(errors)} of {len(outputs)} requests failed: {errors[0].error}",
                                partial_outputs=outputs)
        return outputs

    def begin_stage(self, switch_schedule: list[tuple[int, int]] | None = None, kv_transfer: str | None = None,
                    policy: SwitchPolicy | None = None, from_base_layout: bool = True) -> None:
        """Start a generation stage (an RL rollout batch) for requests sent with ``submit``.

        Returns to the base layout (an idle switch when nothing runs) and restarts the stage's
        decode-step count; ``switch_schedule`` or ``policy`` replace the engine's policy for the
        stage, otherwise the engine's own policy (the controller, when a table is loaded) goes on.
        ``generate`` does the same for its own batch.
        """
        self._ensure_open()
        self._loop.run(self._stage_starter(switch_schedule, kv_transfer, policy, from_base_layout))

    def _stage_starter(self, switch_schedule, kv_transfer, policy, from_base_layout) -> Callable[[], None]:
        """Validate the stage options now; return the closure that starts the stage in the loop."""
        if switch_schedule is not None:
            for _, tp in switch_schedule:
                self._check_layout(tp)
            if kv_transfer not in (None, "migrate", "recompute"):
                raise InvalidRequestError(f"kv_transfer must be 'migrate' or 'recompute', got {kv_transfer!r}")
            policy = ScheduledSwitches(switch_schedule, kv_transfer)

        def start() -> None:
            coord = self.coordinator
            if from_base_layout and coord.layout != self.base_layout:
                coord.switch(SwitchDecision(self.base_layout.tp, "new stage: base layout"))
            coord.start_stage(policy if policy is not None else coord.policy)

        return start

    # ---- layout -----------------------------------------------------------------------------

    def reconfigure(self, tp: int, kv_transfer: str | None = None, timeout: float | None = None) -> SwitchEvent:
        """Switch to TP ``tp`` (dp = world / tp) at the next step boundary, mid-batch if one runs.

        Returns the switch's record once it is done. Invalid targets are refused before anything moves.
        """
        self._ensure_open()
        self._check_layout(tp)
        if kv_transfer not in (None, "migrate", "recompute"):
            raise InvalidRequestError(f"kv_transfer must be 'migrate' or 'recompute', got {kv_transfer!r}")
        decision = SwitchDecision(tp, "reconfigure() call", kv_transfer)
        return self._loop.run(self.coordinator.switch, decision, timeout=timeout)

    def set_policy(self, policy: SwitchPolicy | None) -> None:
        """Install the policy consulted every ``switch_check_interval`` decode steps."""
        self._loop.run(lambda: setattr(self.coordinator, "policy", policy))

    def _ensure_open(self) -> None:
        if self._closed:
            from pat_engine.errors import EngineClosedError

            raise EngineClosedError("the engine has been shut down")
        if self._loop.dead is not None:  # refuse at once; admit() checks again in the loop thread
            raise EngineDeadError(self._loop.dead)

    @property
    def dead(self) -> str | None:
        """Why the engine cannot serve any more, or None while it can."""
        return self._loop.dead

    def health(self) -> dict:
        """Workers alive, age of the oldest step in flight and of the last result, restarts (any thread)."""
        return self._loop.health()


def raise_if_no_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise InvalidRequestError("device='cuda' but no CUDA device is visible")
