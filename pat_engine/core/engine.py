"""``Engine``: the Python API of pat-engine.

    from pat_engine import Engine, SamplingParams
    with Engine("path/to/model", tp=1, dp=4, dtype="float64") as engine:
        outs = engine.generate(["a prompt", [1, 2, 3]], SamplingParams(max_new_tokens=64),
                               switch_schedule=[(32, 4)])  # go to TP4 at decode step 32

Every method can be called from any thread. ``Engine`` is a facade: each area forwards to
the ``GlobalCoordinator`` service that owns it (requests and steps: ``Stepping``; layout:
``Switching``; RL weight updates: ``WeightSync``; memory for a colocated trainer:
``MemoryRelease``). A service method that touches driver state runs in the engine loop
thread between steps (``loop_thread.on_loop``); Engine methods check arguments and hand over.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import weakref
from typing import Any, Iterable, Iterator, Sequence as Seq

import torch
from tqdm.auto import tqdm

from pat_engine.config import EngineConfig
from pat_engine.core.chat import chat_options, chat_prompt, install_chat_template
from pat_engine.core.controller_setup import attach_controller
from pat_engine.core.coordinator import GlobalCoordinator
from pat_engine.core.inputs import RequestFactory, load_tokenizer
from pat_engine.core.loop import EngineLoop
from pat_engine.core.memory import MemoryPlan, default_cpu_kv_bytes
from pat_engine.core.profiling import Profiling
from pat_engine.core.request import Sequence
from pat_engine.core.request_handle import RequestHandle
from pat_engine.core.restart_budget import RestartBudget
from pat_engine.core.served_weights import ServedWeights
from pat_engine.core.step_records import StepRecord
from pat_engine.core.stepping import PAUSE_MODES
from pat_engine.core.timeline import SwitchEvent
from pat_engine.core.weight_sync import DEFAULT_BUCKET_BYTES, HandleBucket
from pat_engine.core.worker_pool import WorkerPool
from pat_engine.errors import EngineClosedError, EngineDeadError, InvalidRequestError, ModelLoadError, WorkerFailure
from pat_engine.model.arch import load_model_arch
from pat_engine.model.weights import check_safetensors_headers, safetensors_files
from pat_engine.outputs import RequestOutput, of_prompt
from pat_engine.parallel.dp_placement import PlacementRule
from pat_engine.parallel.layout import Layout
from pat_engine.predictor.cost_source import CostSource
from pat_engine.predictor.policy import ClusterStatus, ScheduledSwitches, SwitchPolicy
from pat_engine.protocol.calls import AllocateKV, KVBudget
from pat_engine.sampling.params import SamplingParams

log = logging.getLogger(__name__)

# Engines not shut down yet. An engine dropped without ``shutdown`` stays alive (its loop thread holds it),
# so ``__del__`` never runs: at interpreter exit these are shut down first, so that no loop thread is still
# polling its workers while the interpreter tears down the modules it uses (which can crash the exit).
_RUNNING: "weakref.WeakSet[Engine]" = weakref.WeakSet()
os.register_at_fork(after_in_child=_RUNNING.clear)  # a forked child exiting normally leaves them alone


@atexit.register
def _shut_down_running_engines() -> None:
    for engine in list(_RUNNING):
        engine.shutdown()


class Engine:
    def __init__(self, model: str, tp: int = 1, dp: int = 1, **kwargs: Any):
        self.config = EngineConfig.from_kwargs(model, tp=tp, dp=dp, **kwargs)
        cfg = self.config
        self.arch = load_model_arch(cfg.model)  # unknown architecture / missing files fail here, before spawning
        check_safetensors_headers(safetensors_files(cfg.model))  # a damaged file is named before spawning
        self.base_layout = self.arch.layout(cfg.world, cfg.tp)
        tokenizer_dir = cfg.tokenizer or cfg.model
        self.tokenizer = load_tokenizer(tokenizer_dir, required=cfg.tokenizer is not None)
        if cfg.chat_template is not None:
            install_chat_template(self.tokenizer, cfg.chat_template, tokenizer_dir)
        max_len = min(cfg.max_model_len or self.arch.max_position, self.arch.max_position)
        self.request_factory = RequestFactory(self.arch, self.tokenizer, max_len, cfg.seed)
        self.weights = ServedWeights(cfg.model)
        dtype = cfg.torch_dtype()
        on_gpu = cfg.device == "cuda"
        if on_gpu:
            raise_if_no_cuda()
        measure = on_gpu and cfg.kv_cache_bytes is None  # GPU: size the KV pool from free memory
        kv_bytes = cfg.kv_cache_bytes or (0 if measure else default_cpu_kv_bytes(
            self.arch, dtype, cfg.block_size, self.base_layout, cfg.max_num_seqs, max_len))
        self.memory = MemoryPlan(self.arch, dtype, cfg.block_size, kv_bytes, self.base_layout, device_budget=on_gpu)
        pool = self._start_pool(kv_blocks=0 if measure else None)
        if pool.placement.colocated:  # a labelled test/dev mode (parallel/devices.py)
            log.warning("%s", pool.placement.describe())
        if measure:
            try:
                self.memory.kv_budget_base = pool.ask(KVBudget())
                pool.ask(AllocateKV(self.memory.num_blocks(self.base_layout)))
            except BaseException:
                pool.kill()
                raise
        if self.memory.num_blocks(self.base_layout) < 1:
            pool.kill()
            raise InvalidRequestError(f"the KV budget ({self.memory.kv_budget_base} bytes per rank) holds no KV block")
        self.coordinator = GlobalCoordinator(cfg, self.memory, pool, self.base_layout, self.weights)
        # one forward per area: each public method below hands over to one of these
        self._stepping = self.coordinator.stepping
        self._profiling = Profiling(self._stepping.ask_profilers)
        self._switching = self.coordinator.switching
        self._weight_sync = self.coordinator.weight_sync
        self._memory = self.coordinator.memory_release
        self._loop = EngineLoop(self.coordinator, self._start_pool,
                                RestartBudget(cfg.max_worker_restarts, cfg.restart_window_s), cfg.recover_failed_workers,
                                self.weights)
        self._closed = False
        _RUNNING.add(self)
        try:
            attach_controller(self)
        except BaseException:
            self.shutdown()
            raise

    def _start_pool(self, kv_blocks: int | None = None) -> WorkerPool:
        blocks = self.memory.num_blocks(self.base_layout) if kv_blocks is None else kv_blocks
        pool = WorkerPool(self.config, self.base_layout, blocks, self.weights.path)
        try:
            pool.start()
        except WorkerFailure as exc:
            if exc.error_type == "ModelLoadError":  # a bad checkpoint, found while loading shards
                raise ModelLoadError(str(exc).splitlines()[0]) from None
            if exc.error_type == "InvalidRequestError":  # e.g. a memory share that cannot hold the weights
                raise InvalidRequestError(str(exc).splitlines()[0]) from None
            raise
        return pool

    # ---- context manager / lifecycle ------------------------------------------------------------

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        _RUNNING.discard(self)
        self._loop.stop()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

    # ---- state ---------------------------------------------------------------------------------

    @property
    def layout(self) -> Layout:
        return self._stepping.layout

    @property
    def policy(self) -> SwitchPolicy | None:
        """The policy consulted every ``switch_check_interval`` decode steps (None: static)."""
        return self._switching.policy

    @property
    def worker_failures(self) -> list[str]:
        """Every worker failure the engine recovered from or reported, oldest first."""
        return list(self._loop.failures)

    def prefix_cache_stats(self) -> dict:
        """Prefix-cache hit rate (prompt tokens found cached at admission), cached and used KV blocks."""
        return self._stepping.prefix_cache_stats()

    def worker_pids(self) -> list[int]:
        """Process ids of the current worker processes, by rank."""
        return self._stepping.worker_pids()

    @property
    def max_model_len(self) -> int:
        """The longest prompt + generation a request may have (the model's context, or the configured cap)."""
        return self.request_factory.max_model_len

    @property
    def timeline(self) -> dict:
        return self._switching.timeline.to_dict()

    @property
    def switches(self) -> list[SwitchEvent]:
        return list(self._switching.timeline.switches)

    @contextlib.contextmanager
    def record_steps(self) -> Iterator[list[StepRecord]]:
        """Collect a ``StepRecord`` for every step run inside the ``with`` block."""
        log: list[StepRecord] = []
        self._stepping.set_step_log(log)
        try:
            yield log
        finally:
            self._stepping.set_step_log(None)

    def start_profile(self, output_dir: str | None = None, *, num_steps: int | None = None,
                      record_shapes: bool = False, with_stack: bool = False) -> str:
        """Profile every worker's work with ``torch.profiler`` (CPU operators, and CUDA kernels on a GPU) until
        ``stop_profile``, or for ``num_steps`` steps of each rank. Returns the folder the files go to:
        ``output_dir``, else ``$PAT_TORCH_PROFILER_DIR``, else a new temporary one. One profile at a time."""
        return self._profiling.start(output_dir, num_steps, record_shapes, with_stack)

    def stop_profile(self) -> list[str]:
        """End the profile (each rank's own, if its ``num_steps`` have not ended it); the files the ranks wrote:
        per rank a Chrome trace (``.pt.trace.json.gz``) and its operators by self time (``.table.txt``)."""
        return self._profiling.stop()

    def measure_bandwidth(self, nbytes: int = 8 << 20, repeats: int = 3, path: str | None = None) -> float:
        """One-way per-rank point-to-point bandwidth (bytes/s), every rank sending at once, along ``path``
        ("direct", "host" or "handles", parallel/p2p.py; None: the path this world's switches take)."""
        try:
            seconds = self._stepping.bandwidth_probe(nbytes, repeats, path)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        slowest = max(seconds)
        return float("inf") if slowest == 0 else nbytes / slowest

    def kv_blocks(self) -> dict:
        """Free, cached and total KV blocks per DP group, and whether the block invariants hold (free +
        cached + in use == total, reference counts equal the tables); reported, not raised."""
        return self._stepping.kv_blocks()

    def worker_stats(self, release_cached: bool = False) -> list[dict]:
        """Per rank: group cache, KV blocks, graphs, device, allocator counters (``device_memory``: CUDA
        bytes allocated / reserved / peak). ``release_cached`` first hands the CUDA allocator's unused
        cached blocks back, so two readings compare what each rank holds (a leak check)."""
        return self._stepping.worker_stats(release_cached)

    # ---- speculative decoding (docs/speculative.md) -----------------------------------------------

    def speculation_stats(self) -> dict | None:
        """Verify steps, drafted and accepted tokens, acceptance rate and tokens per step (None: off)."""
        return self._stepping.speculation_stats()

    def remember_responses(self, prompt: Any, responses: Seq[Seq[int]]) -> None:
        """Earlier responses to ``prompt`` (text or token ids) as draft sources for later requests with
        the same prompt; kept across batches with ``speculative={"history": True}``."""
        ids, _ = self.request_factory.tokenize(prompt, "")
        self._stepping.remember_responses(ids, [list(r) for r in responses])

    def set_draft_proposer(self, proposer: Any) -> None:
        """Draft with ``proposer`` (``pat_engine.speculative.proposer.DraftProposer``) instead of the n-gram one."""
        self._stepping.set_draft_proposer(proposer)

    # ---- requests --------------------------------------------------------------------------------

    def _make(self, prompts: Seq[Any], params: SamplingParams | Seq[SamplingParams] | None,
              request_ids: Seq[str] | None) -> list[list[Sequence]]:
        """Validated sequences, one list per prompt (its ``n`` samples, sample 0 first)."""
        if self._memory.state.asleep:
            raise InvalidRequestError(f"the engine is asleep ({self._memory.state.describe()} released); "
                                      "call wake_up() before generating")
        if (refusal := self.weights.refusal()) is not None:
            raise InvalidRequestError(refusal)
        return self.request_factory.make_batch(prompts, params, request_ids, self.memory, self.layout)

    def submit(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None) -> RequestHandle:
        """Queue one request (``n`` = 1) and return at once (used by the server and streaming)."""
        if params is not None and params.n > 1:
            raise InvalidRequestError(f"submit() queues one sample; use submit_samples() for n={params.n}")
        return self.submit_samples(prompt, params, request_id)[0]

    def submit_samples(self, prompt: Any, params: SamplingParams | None = None,
                       request_id: str | None = None) -> list[RequestHandle]:
        """Queue the ``params.n`` samples of one prompt (one request id; they share the prompt's KV)
        and return a handle per sample, sample 0 first."""
        self._ensure_open()
        samples = self._make([prompt], params, [request_id] if request_id else None)[0]
        handles = [RequestHandle(s, self.request_factory.decode) for s in samples]
        self._loop.admit(samples)
        return handles

    def check_request(self, prompt: Any, params: SamplingParams | None = None) -> None:
        """Refuse (``InvalidRequestError``) what ``submit_samples`` would refuse, queuing nothing."""
        self._ensure_open()
        self._make([prompt], params, None)

    def abort(self, request_ids: Iterable[str]) -> int:
        """Stop requests; they finish with reason "abort" and keep what they generated."""
        return self._loop.abort_requests(set(request_ids))

    def abort_all(self, message: str = "aborted by the caller") -> int:
        """Abort every unfinished request (each keeps what it generated); returns how many."""
        return self._stepping.abort_all(message)

    def cluster_status(self) -> ClusterStatus:
        """A ``ClusterStatus`` snapshot: the layout and, per DP group, its requests and free KV blocks."""
        return self._stepping.status()

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
        families = self._make(prompts, params, request_ids)
        stage_policy = self._switching.stage_policy(switch_schedule, kv_transfer, policy)
        handles = [RequestHandle(s, self.request_factory.decode) for family in families for s in family]
        bar = tqdm(total=len(handles), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)

        self._loop.start_batch(families, stage_policy, self.base_layout if from_base_layout else None)
        try:
            finished = 0
            while finished < len(handles):
                handles[finished].wait(0.2)
                done = sum(h.done() for h in handles)
                if done != bar.n:
                    bar.update(done - bar.n)
                    bar.set_postfix_str(str(self.layout), refresh=False)
                while finished < len(handles) and handles[finished].done():
                    finished += 1
                if self._loop.dead and finished < len(handles):
                    raise WorkerFailure(self._loop.dead, partial_outputs=[h.output() for h in handles])
        finally:
            bar.close()
        outputs, start = [], 0
        for family in families:  # one output per prompt, carrying its samples when n > 1
            outputs.append(of_prompt([h.output() for h in handles[start : start + len(family)]]))
            start += len(family)
        errors = [s for o in outputs for s in (o.samples or [o]) if s.finish_reason == "error"]
        if errors:
            raise WorkerFailure(f"{len(errors)} of {len(handles)} requests failed: {errors[0].error}",
                                partial_outputs=outputs)
        return outputs

    def chat(self, messages: Seq[dict] | Seq[Seq[dict]], params: SamplingParams | Seq[SamplingParams] | None = None,
             *, add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None,
             **generate_kwargs: Any) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of OpenAI-style messages) or a list of them, each
        rendered with the chat template (``core/chat.py``; ``tools``: OpenAI function definitions shown to
        the model) and generated as ``generate`` does (its keywords pass through); every conversation is
        checked before any is queued."""
        self._ensure_open()
        options = chat_options(add_generation_prompt=add_generation_prompt, tools=tools,
                               continue_final_message=continue_final_message,
                               chat_template_kwargs=chat_template_kwargs)
        single = not messages or isinstance(messages[0], dict)
        prompts = []
        for i, conversation in enumerate([messages] if single else messages):
            try:
                prompts.append(chat_prompt(self.tokenizer, conversation, options, self.max_model_len)[0])
            except InvalidRequestError as exc:
                raise InvalidRequestError(str(exc) if single else f"conversation {i}: {exc}") from None
        return self.generate(prompts, params, **generate_kwargs)

    def begin_stage(self, switch_schedule: list[tuple[int, int]] | None = None, kv_transfer: str | None = None,
                    policy: SwitchPolicy | None = None, from_base_layout: bool = True) -> None:
        """Start a generation stage (an RL rollout batch) for requests sent with ``submit``.

        Returns to the base layout (an idle switch when nothing runs) and restarts the stage's
        decode-step count; ``switch_schedule`` or ``policy`` replace the engine's policy for the
        stage, otherwise the engine's own policy (the controller, when a table is loaded) goes on.
        ``generate`` does the same for its own batch.
        """
        self._ensure_open()
        self._switching.start_stage(self._switching.stage_policy(switch_schedule, kv_transfer, policy),
                                    self.base_layout if from_base_layout else None)

    def scheduled_policy(self, switch_schedule: list[tuple[int, int]], kv_transfer: str | None = None) -> ScheduledSwitches:
        """A fixed switch schedule ``[(decode_step, tp), ...]``, every target checked against this
        model and world first (``LayoutError`` names a bad one)."""
        return self._switching.scheduled_policy(switch_schedule, kv_transfer)

    # ---- layout -----------------------------------------------------------------------------

    def reconfigure(self, tp: int, kv_transfer: str | None = None, timeout: float | None = None) -> SwitchEvent:
        """Switch to TP ``tp`` (dp = world / tp) at the next step boundary, mid-batch if one runs.

        Returns the switch's record once it is done. Invalid targets are refused before anything moves.
        """
        self._ensure_open()
        return self._switching.reconfigure(tp, kv_transfer, timeout)

    def set_policy(self, policy: SwitchPolicy | None, cost_source: CostSource | None = None) -> None:
        """Install the policy consulted every ``switch_check_interval`` decode steps, and with it the
        source a switch prices its KV path with (None: keep the current one)."""
        self._switching.set_policy(policy, cost_source)

    def set_placement(self, placement: PlacementRule | None) -> None:
        """Install the DP-group rule used at admission (None: fewest outstanding tokens).

        ``placement(seq, group_schedulers) -> group index`` (a ``parallel.dp_placement.PlacementRule``).
        """
        self._stepping.set_placement(placement)

    # ---- RL: weight sync (WeightSync) ---------------------------------------------------------------

    def check_weight_update(self, names: list[str], shapes: list[tuple[int, ...]], dtypes: list) -> None:
        """Refuse a whole update before anything is applied: an unknown name, a wrong shape, a dtype
        that is not floating point, or lists of different lengths (``InvalidRequestError`` names it)."""
        self._weight_sync.check_update(names, shapes, dtypes)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES, weight_version: str | None = None) -> int:
        """Load new weights from ``(hf_name, full_tensor)`` pairs; returns how many tensors were applied.

        Names and shapes are checked before anything is sent. Runs at a step boundary; requests in
        flight continue with the new weights (as vLLM and SGLang do). ``weight_version`` names the
        new weights in outputs (default: the count of updates so far).
        """
        self._ensure_open()
        return self._weight_sync.from_tensors(named_tensors, bucket_bytes, weight_version)

    def update_weights_from_handles(self, buckets: HandleBucket | Iterable[HandleBucket],
                                    weight_version: str | None = None, final: bool = True) -> int:
        """Load weights a colocated trainer shares by handle (CUDA IPC on GPUs, shared memory on CPU).

        Each bucket is a payload from ``pat_engine.model.weight_handles.serialize_named_tensors`` (or
        ``serialize_buckets``), or a list with one payload per worker rank (SGLang's
        ``serialized_named_tensors``: worker ``r`` takes entry ``r % len``). Every worker rebuilds the
        handles and copies only its own shard under the current layout; one bucket is in flight at a
        time, and the trainer must keep a bucket's tensors alive until the next one is asked for (or
        this call returns). Names and shapes are checked on the workers before a bucket is applied.
        ``final=False``: more buckets follow in a later call; the weight version is counted (and the
        prefix cache dropped) by the call with ``final=True``. Returns how many tensors were applied.
        """
        self._ensure_open()
        if isinstance(buckets, (bytes, bytearray, memoryview)):
            buckets = [buckets]
        return self._weight_sync.from_handles(buckets, weight_version, final)

    def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> None:
        """Reload every rank's shard from a checkpoint of the same architecture and shapes."""
        self._ensure_open()
        self._weight_sync.from_disk(path, weight_version)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None,
                                  timeout_s: float | None = None) -> None:
        """Every worker joins a trainer's group (trainer = rank 0, worker r = ``rank_offset + r``).

        Blocks until the trainer has joined too. ``backend`` defaults to gloo on CPU, NCCL on GPU (a torch
        process group, as SGLang's ``init_custom_process_group`` builds); ``"stateless_nccl"`` joins the
        vLLM ``StatelessProcessGroup`` + PyNccl group OpenRLHF's trainer builds (CUDA, vLLM installed).
        """
        self._ensure_open()
        self._weight_sync.join_group(master_address, master_port, rank_offset, world_size, group_name, backend,
                                     timeout_s)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", weight_version: str | None = None,
                                        timeout_s: float | None = None, final: bool = True) -> int:
        """Receive full tensors the trainer broadcasts (in ``names`` order) and load them under the current
        layout. The update is checked whole first; a refused one leaves the weights as they were.
        ``final=False``: more tensors follow in later calls (as ``update_weights_from_handles``)."""
        self._ensure_open()
        return self._weight_sync.from_distributed(names, dtypes, shapes, group_name, weight_version, timeout_s,
                                                  final)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> bool:
        self._ensure_open()
        return self._weight_sync.leave_group(group_name)

    @property
    def weight_version(self) -> str:
        return self.weights.version

    # ---- RL: memory for a colocated trainer, pausing between steps ---------------------------------

    def sleep(self, level: int = 1, tags: list[str] | None = None) -> int:
        """Release memory for a colocated trainer; returns the bytes freed (summed over ranks).

        level 1: the KV cache (on GPU the weights also move to host memory);
        level 2: the KV cache and the weights (``wake_up`` reloads them from disk, or call
        ``update_weights`` after waking). ``tags`` (SGLang's ``kv_cache``, ``weights``,
        ``cuda_graph``) release exactly those instead; released weights are discarded.
        Runs at a step boundary: running requests give their KV back and are prefilled again after
        the wake-up (same tokens); nothing runs while any memory is released. Releasing what is
        already released is a no-op.
        """
        self._ensure_open()
        return self._memory.sleep(level, tags)

    def wake_up(self, tags: list[str] | None = None) -> list[str]:
        """Restore what ``sleep`` released (``tags``: only "weights", "kv_cache" or "cuda_graph");
        returns what was restored. Whatever was not released is left alone: waking an awake engine
        is a no-op and never touches running requests or the prefix cache."""
        self._ensure_open()
        return self._memory.wake_up(tags)

    @property
    def sleeping(self) -> bool:
        """Whether any memory is released (``sleep`` without the matching ``wake_up``)."""
        return self._memory.state.asleep

    def released_memory(self) -> list[str]:
        """The memory tags released now."""
        return sorted(self._memory.state.released())

    def pause(self, mode: str = "in_place") -> int:
        """Stop starting new steps until ``resume``; returns how many requests the mode touched.

        ``in_place``: requests keep their KV and continue where they were. ``retract``: every
        running request frees its KV and waits to be prefilled again (same tokens: sampling depends
        only on (seed, position)). ``abort``: every unfinished request finishes with reason "abort",
        keeping what it generated. Requests submitted while paused wait.
        """
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        return self._stepping.pause(mode)

    def resume(self) -> None:
        self._stepping.resume()

    @property
    def paused(self) -> bool:
        return self._stepping.paused

    def flush_cache(self) -> bool:
        """Drop the prefix cache (cached blocks are freed; blocks in use are no longer found by later
        requests), as vLLM's ``reset_prefix_cache`` and SGLang's ``flush_cache``."""
        self._stepping.flush_prefix_cache()
        return True

    def num_unfinished_requests(self) -> int:
        return self._stepping.num_unfinished()

    def _ensure_open(self) -> None:
        if self._closed:
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
