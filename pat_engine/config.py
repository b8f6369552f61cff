"""The user's engine configuration: frozen, fixed for the engine's life.

The current layout, block counts and groups are runtime *state* and live in
the coordinator and workers, never here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pat_engine.errors import InvalidRequestError
from pat_engine.model.layers.attention import BACKEND_NAMES
from pat_engine.speculative.config import SpeculativeConfig

if TYPE_CHECKING:  # for annotations only
    from pat_engine.model.arch import ModelArch

KV_PATHS = ("migrate", "recompute")  # how a switch carries unfinished requests' KV
NUMERICS = ("invariant", "fast")  # docs/numerics.md
DEFAULT_NUMERICS = "fast"  # invariant: up to +10% per CPU prefill, +11-17% per H100 decode step (docs/numerics.md)
DEFAULT_MAX_TP = 8  # the invariant mode's declared reduction width: one node of 8 GPUs (docs/numerics.md)
GRAPH_BACKENDS = ("auto", "standin")  # docs/hot-path.md, worker/graph_capture.py
WORKER_LAUNCHES = ("auto", "fresh")  # core/worker_launch.py
DEFAULT_MAX_GRAPH_BATCH = 256
PREFILL_STEP_TOKENS = {"cpu": 2048, "cuda": 8192}  # max_num_batched_tokens' default by device


def graph_ladder(max_batch: int) -> tuple[int, ...]:
    """The padded decode batch sizes graphs are captured for, up to ``max_batch``: 1, 2, 4, 8, then
    steps of 8 to 256 and of 16 beyond (at most 7 padding rows up to 256, 15 beyond), and
    ``max_batch`` itself so that the largest batch allowed never falls back to eager."""
    steps = [1, 2, 4, 8, *range(16, 257, 8), *range(272, max_batch + 1, 16)]
    sizes = [s for s in steps if s <= max_batch]
    return tuple(sizes + [max_batch] if max_batch >= 1 and max_batch not in sizes else sizes)


def graph_sizes_upto(ladder: tuple[int, ...], batch: int) -> tuple[int, ...]:
    """The ladder sizes a decode batch of at most ``batch`` rows can run as (``batch`` rounded up to a
    ladder size, and every smaller one); all of them when ``batch`` is past the ladder's end."""
    if batch <= 0:
        return ()
    top = next((s for s in ladder if s >= batch), ladder[-1] if ladder else 0)
    return tuple(s for s in ladder if s <= top)


def auto_device() -> str:
    """The device an engine runs on when its caller names none (pat-serve's ``--device auto``, the RL
    adapters): the GPUs when torch sees one, else CPU worker processes."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_kv_transfer(value: str | None, *, allow_auto: bool) -> None:
    """``kv_transfer`` is a KV path, or "auto" (the cost model decides) where the caller allows it; None
    always means "not forced"."""
    choices = (("auto",) if allow_auto else ()) + KV_PATHS
    if value is not None and value not in choices:
        raise InvalidRequestError(f"kv_transfer must be one of {', '.join(choices)}, got {value!r}")


_DTYPES = {
    "float64": torch.float64,
    "double": torch.float64,
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tp: int = 1  # base tensor-parallel degree
    dp: int = 1  # base data-parallel degree; world = tp * dp stays fixed
    dtype: str = "auto"
    device: str = "cpu"
    tokenizer: str | None = None  # defaults to the model directory
    # a Jinja chat template, or a file holding one, in place of the tokenizer's (vLLM's --chat-template;
    # core/chat.py): base models have none, and RL recipes often render chats their own way
    chat_template: str | None = None
    seed: int = 0  # seeds per-request seeds when a request gives none

    # KV cache and batching
    block_size: int = 16
    kv_cache_bytes: int | None = None  # per rank; CPU: core/memory.default_cpu_kv_bytes, GPU: from memory utilisation
    gpu_memory_utilization: float = 0.85  # of each GPU, for all the engine's ranks on it together
    # the share of its GPU one rank may use (weights, KV, activations, graphs); None: gpu_memory_utilization
    # split equally among the ranks a device holds. Several ranks per GPU is a test/dev mode (parallel/devices.py)
    rank_memory_fraction: float | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256  # per DP group
    # per prefill step and DP group; None: PREFILL_STEP_TOKENS for the device (a CPU prefill of 8192 tokens makes
    # activations of 134 MB a product that glibc maps afresh and that stream from memory: the greedy long tail of
    # bench/results/cpu_prefill_chunk.md runs 1.11-1.26x faster at 2048, decode-heavy GRPO the same)
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True  # reuse the KV of full blocks of earlier prompts with the same prefix

    # switching
    kv_transfer: str = "auto"  # "auto" (cost model), "migrate" or "recompute"
    # a migrating switch also moves the cached prefixes no request holds (multi-turn rollouts reuse them;
    # single-turn RL never does, so they would only add bytes to its switches): core/layout_switch.py
    switch_keeps_prefix_cache: bool = False
    switch_check_interval: int = 8  # decode steps between policy evaluations
    profile_table: str | None = None  # latency table for the automatic switch controller
    # correct the table's decode-step fit with the engine's own steps (predictor/step_calibration.py);
    # False: the table as profiled, the paper's predictor (its decisions depend on the table alone)
    calibrate_profile: bool = True

    # numerics (docs/numerics.md): "invariant" gives the same bits at every layout, across live switches,
    # batches and deployment sizes (row-parallel products summed over fixed chunks by one tree, GEMMs whose
    # reduction order ignores the row count, prefill attention through the decode kernel); "fast" lets the
    # layout and the batch decide the rounding (one GEMM + all-reduce, SDPA prefill)
    numerics: str = DEFAULT_NUMERICS
    # invariant: the largest TP any deployment of this model may use, a power of two; the row-parallel
    # chunk count is the largest TP up to it the model allows (ModelArch.reduction_width), whatever the
    # world: engines of 1, 2, 4 or 8 ranks and reference_logprobs agree when they declare the same
    max_tp: int = DEFAULT_MAX_TP
    # attention kernels (docs/attention.md): "auto" (Triton on CUDA, torch + the C++ decode kernel on the
    # CPU), "torch", "triton" or "flashinfer" (pip install -e ".[gpu]")
    attention_backend: str = "auto"

    # decode graphs (worker/graph_capture.py): on CUDA the decode forward of each padded batch size up to
    # max_graph_batch (capped at max_num_seqs) is captured once and replayed; prefill and larger batches
    # run eagerly. enforce_eager (vLLM's name) captures nothing. graph_backend "standin" runs the same
    # bookkeeping on any device with eager replays (CPU tests and benchmarks); "auto": CUDA graphs on
    # CUDA, none on the CPU
    enforce_eager: bool = False
    graph_backend: str = "auto"
    max_graph_batch: int = DEFAULT_MAX_GRAPH_BATCH

    # async scheduling (docs/async_scheduling.md, vLLM's --async-scheduling, SGLang's overlap scheduler): a
    # decode step is sent before the one in flight is answered, its tokens taken from that step's draw on
    # the device, so the device does not wait for the driver between steps. Decode steps only; off with
    # speculative decoding, logit processors, and whenever a prefill could start. Tokens and log-probs are the
    # synchronous schedule's (a row ended by a stop token runs once more and its token is dropped). None: on
    # for CUDA (batch-1 decode 7.29 -> 6.22 ms a token on the fourth H100 run, bench/results/gpu_check.md),
    # off on the CPU (no gain there: bench/results/async_scheduling.md); async_scheduling_on() resolves it
    async_scheduling: bool | None = None

    # speculative decoding of small batches without a draft model (docs/speculative.md); off by default.
    # Engine(speculative=True) or a dict of SpeculativeConfig fields turns it on
    speculative: SpeculativeConfig = SpeculativeConfig()

    # processes and failures
    threads_per_worker: int | None = None  # default: cores // world (at least 1)
    worker_start_timeout_s: float = 300.0
    collective_timeout_s: float = 120.0
    step_timeout_s: float = 600.0
    recover_failed_workers: bool = True  # restart the world and recompute unfinished requests
    max_worker_restarts: int = 4  # restarts allowed within any restart_window_s; one more and the engine is dead
    restart_window_s: float = 300.0
    timeline_max_events: int = 10_000  # status points and switch records kept each (oldest dropped first)
    # the Worker subclass every rank runs, as "module:Class" (vLLM's worker_cls); None: pat_engine's Worker.
    # Tests inject faults through one (bench/fault_injection.py), so the real worker's hot path has no hooks
    worker_class: str | None = None
    # how worker processes start (core/worker_launch.py): "auto" forks CPU workers from a warm fork server (no
    # import of torch per worker) and starts GPU workers as fresh interpreters; "fresh": CPU workers too
    worker_launch: str = "auto"

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1:
            raise InvalidRequestError(f"tp and dp must be >= 1, got tp={self.tp}, dp={self.dp}")
        check_kv_transfer(self.kv_transfer, allow_auto=True)
        if self.numerics not in NUMERICS:
            raise InvalidRequestError(f"numerics must be one of {', '.join(NUMERICS)}, got {self.numerics!r}")
        if self.max_tp < 1 or self.max_tp & (self.max_tp - 1):
            raise InvalidRequestError(f"max_tp must be a power of two, got {self.max_tp}")
        if self.numerics == "invariant" and self.tp > self.max_tp:
            raise InvalidRequestError(f"numerics='invariant' with max_tp={self.max_tp} cannot run tp={self.tp}: "
                                      "declare max_tp >= the largest TP the deployment uses")
        if self.attention_backend not in BACKEND_NAMES:
            raise InvalidRequestError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}, "
                                      f"got {self.attention_backend!r}")
        if self.device not in ("cpu", "cuda"):
            raise InvalidRequestError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.max_num_batched_tokens is None:  # frozen: set once, here
            object.__setattr__(self, "max_num_batched_tokens", PREFILL_STEP_TOKENS[self.device])
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise InvalidRequestError(f"unknown dtype {self.dtype!r}; choose from {sorted(_DTYPES)} or 'auto'")
        if self.graph_backend not in GRAPH_BACKENDS:
            raise InvalidRequestError(f"graph_backend must be one of {', '.join(GRAPH_BACKENDS)}, "
                                      f"got {self.graph_backend!r}")
        if self.max_graph_batch < 1:
            raise InvalidRequestError(f"max_graph_batch must be >= 1, got {self.max_graph_batch}")
        if self.worker_launch not in WORKER_LAUNCHES:
            raise InvalidRequestError(f"worker_launch must be one of {', '.join(WORKER_LAUNCHES)}, "
                                      f"got {self.worker_launch!r}")
        if self.worker_class is not None and not all(self.worker_class.partition(":")[::2]):
            raise InvalidRequestError(f"worker_class must be 'module:Class', got {self.worker_class!r}")
        for name in ("gpu_memory_utilization", "rank_memory_fraction"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:  # NaN fails too
                raise InvalidRequestError(f"{name} must be a fraction in (0, 1], got {value!r}")
        if self.rank_memory_fraction is not None and self.device != "cuda":
            raise InvalidRequestError("rank_memory_fraction is a share of a GPU's memory: it needs device='cuda' "
                                      "(CPU workers size their KV from kv_cache_bytes or the host's memory)")
        if self.block_size < 1:
            raise InvalidRequestError(f"block_size must be >= 1, got {self.block_size}")
        for name in ("worker_start_timeout_s", "collective_timeout_s", "step_timeout_s", "restart_window_s"):
            if not getattr(self, name) > 0:  # NaN fails too
                raise InvalidRequestError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.max_worker_restarts < 0:
            raise InvalidRequestError(f"max_worker_restarts must be >= 0, got {self.max_worker_restarts}")
        if self.timeline_max_events < 1:
            raise InvalidRequestError(f"timeline_max_events must be >= 1, got {self.timeline_max_events}")
        if not isinstance(self.speculative, SpeculativeConfig):
            raise InvalidRequestError("speculative must be a SpeculativeConfig (from_kwargs also takes a dict or a bool)")
        if self.speculative.enabled:
            self.speculative.check_exact(self.numerics, self.torch_dtype())

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        if "speculative" in kwargs:
            kwargs["speculative"] = SpeculativeConfig.of(kwargs["speculative"])
        return cls(model=str(model), **kwargs)

    @property
    def host_free_during_steps(self) -> bool:
        """Whether the workers compute apart from the host's cores (a GPU), so host work done while a step
        runs costs the step nothing: async scheduling's default, ranks holding answers, the controller
        deciding while steps compute. CPU workers use the host's cores."""
        return self.device == "cuda"

    def async_scheduling_on(self) -> bool:
        """Whether decode steps are sent ahead: as set, else where the host is free during steps (CUDA)."""
        return self.host_free_during_steps if self.async_scheduling is None else self.async_scheduling

    def graphs(self, arch: ModelArch | None = None) -> str | None:
        """Which decode graphs the workers capture: "cuda", "standin", or None (every step eager). With the served
        ``arch``: no CUDA graphs for a model whose layers read their routing on the host (``ModelArch.routes_on_host``:
        the invariant mode's MoE layers, or any where the fused experts are off; a graph cannot capture that),
        which the stand-in's eager replays run."""
        if self.enforce_eager:
            return None
        if self.graph_backend == "standin":
            return "standin"
        if self.device != "cuda" or (arch is not None and arch.routes_on_host(self.device, self.numerics,
                                                                                self.torch_dtype())):
            return None
        return "cuda"

    def decode_graph_ladder(self, arch: ModelArch | None = None) -> tuple[int, ...]:
        """The batch sizes captured (empty when graphs are off)."""
        return graph_ladder(min(self.max_graph_batch, self.max_num_seqs)) if self.graphs(arch) else ()

    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        cfg_file = Path(self.model) / "config.json"
        name = "float32"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
            name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        if self.device == "cpu" and name in ("float16", "half"):
            name = "float32"  # fp16 matmuls on CPU are slow and lossy; bf16 stays bf16
        return _DTYPES.get(name, torch.float32)

    def worker_threads(self) -> int:
        """torch threads per worker: the cores shared out over the world (at least 1)."""
        if self.threads_per_worker:
            return self.threads_per_worker
        return max(1, _cores() // self.world)

    def worker_env(self) -> dict[str, str]:
        """Environment for the CPU worker processes: OpenMP's wait policy and the allocator's huge pages,
        each only where the user's environment does not set it (GPU workers get none).

        Between kernels a thread spins or sleeps. Where the world's threads have the cores to
        themselves the runtime's default stands (libgomp spins 300000 rounds, then
        sleeps): a TP1 engine on this 2-core VM decodes 7-14% faster than with sleeping threads,
        whose every kernel waits for a wake-up. Where the threads outnumber the cores, spinning only
        stalls the others, so PASSIVE. Spinning loses when other processes share the cores (26-48%
        with two busy processes beside it, where a 10000 spin loses 11-24% and gains less quiet):
        bench/results/omp_wait_policy_ab.md. On a crowded host set OMP_WAIT_POLICY=PASSIVE.

        glibc maps every buffer above 32 MiB afresh and unmaps it on free, so a decode step's large
        buffers (the logits: 58 MB at 96 rows x Qwen's 151,936 tokens) are faulted in 4 KiB page by
        page every step. ``glibc.malloc.hugetlb=1`` asks for transparent huge pages on those
        mappings (where the kernel's THP mode is ``madvise``): 2 MiB faults, 1/512 as many, and
        freed memory still goes back to the OS at once. A heap that keeps freed buffers (a fixed 32 MiB mmap
        threshold, a 1 GiB trim threshold) was no steadier: 0.86-1.13x by workload (bench/results/worker_malloc.md).
        """
        if self.device != "cpu":
            return {}
        env = {}
        if not any(name in os.environ for name in _OMP_WAIT_VARS) and self.world * self.worker_threads() > _cores():
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        if _GLIBC_TUNABLES not in os.environ:
            env[_GLIBC_TUNABLES] = "glibc.malloc.hugetlb=1"
        return env


_OMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # libgomp reads GOMP_SPINCOUNT over the policy
_GLIBC_TUNABLES = "GLIBC_TUNABLES"  # glibc reads it at start-up; other C libraries ignore it


def _cores() -> int:
    """Cores this process may run on (the affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
