"""Command-line engine options shared by ``pat-serve batch``, ``serve`` and ``demo``.

Layout: ``--tp`` plus either ``--dp`` or ``--world`` (world = tp * dp).
Switching: ``--profile TABLE`` (the predictor-driven controller) or
``--switch-schedule "32:4,64:2"`` (go to TP4 at decode step 32, to TP2 at 64),
or neither (a static layout).
Device and batching: vLLM's names (``--device``, ``--gpu-memory-utilization``, ``--enforce-eager``,
``--max-num-seqs``, ``--max-num-batched-tokens``, ``--enable-prefix-caching``, ``--block-size``,
``--attention-backend``, ``--tensor-parallel-size`` / ``--data-parallel-size`` beside ``--tp`` / ``--dp``);
each left out keeps ``EngineConfig``'s default. ``--device auto`` runs on the GPU when torch sees one.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pat_engine.config import DEFAULT_NUMERICS, NUMERICS, PREFILL_STEP_TOKENS, EngineConfig, auto_device
from pat_engine.core.engine import Engine
from pat_engine.errors import InvalidRequestError, LayoutError
from pat_engine.model.layers.attention import BACKEND_NAMES
from pat_engine.parallel.layout import Layout


def parse_schedule(text: str) -> list[tuple[int, int]]:
    """``"32:4,64:2"`` -> ``[(32, 4), (64, 2)]``; raises ``argparse.ArgumentTypeError`` naming the bad item."""
    out = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        step, sep, tp = item.partition(":")
        try:
            if not sep:
                raise ValueError
            pair = (int(step), int(tp))
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad schedule item {item!r}; expected DECODE_STEP:TP, e.g. 32:4") from None
        if pair[0] < 0 or pair[1] < 1:
            raise argparse.ArgumentTypeError(f"bad schedule item {item!r}; step must be >= 0 and tp >= 1")
        out.append(pair)
    if not out:
        raise argparse.ArgumentTypeError("empty switch schedule")
    return out


@dataclass(frozen=True)
class EngineArgs:
    model: str
    tp: int = 1
    dp: int | None = None
    world: int | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    seed: int = 0
    profile: str | None = None
    switch_schedule: tuple[tuple[int, int], ...] | None = None
    kv_transfer: str = "auto"
    threads_per_worker: int | None = None
    step_timeout_s: float = 600.0
    start_timeout_s: float = 300.0
    max_worker_restarts: int = 4
    restart_window_s: float = 300.0
    numerics: str = DEFAULT_NUMERICS
    speculative: bool = False  # n-gram speculative decoding of the tail (docs/speculative.md)
    speculative_history: bool = False  # also draft from earlier responses to the same prompt
    async_scheduling: bool | None = None  # send each decode step before the one in flight is answered (None: CUDA)
    device: str = "auto"  # "cuda", "cpu", or "auto": the GPU when torch sees one
    enforce_eager: bool = False  # no CUDA graphs
    # None: EngineConfig's default
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None
    block_size: int | None = None
    attention_backend: str | None = None
    switch_keeps_prefix_cache: bool | None = None
    max_tp: int | None = None
    tokenizer: str | None = None
    chat_template: str | None = None

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "EngineArgs":
        sched = tuple(ns.switch_schedule) if ns.switch_schedule else None
        return cls(ns.model, ns.tp, ns.dp, ns.world, ns.dtype, ns.max_model_len, ns.kv_cache_bytes, ns.seed,
                   ns.profile, sched, ns.kv_transfer, ns.threads_per_worker, ns.step_timeout, ns.start_timeout,
                   ns.max_worker_restarts, ns.restart_window, ns.numerics, ns.speculative, ns.speculative_history,
                   ns.async_scheduling, device=ns.device, enforce_eager=ns.enforce_eager,
                   **{name: getattr(ns, name) for name in _OPTIONAL})

    def resolved_device(self) -> str:
        return auto_device() if self.device == "auto" else self.device

    def layout(self) -> Layout:
        """The base layout; ``--world`` and ``--dp`` must agree when both are given."""
        if self.world is not None:
            layout = Layout.for_world(self.world, self.tp)
            if self.dp is not None and self.dp != layout.dp:
                raise LayoutError(f"--world {self.world} with --tp {self.tp} gives dp={layout.dp}, not --dp {self.dp}")
            return layout
        return Layout(self.tp, self.dp or 1)

    def engine_kwargs(self) -> dict:
        """The ``Engine`` / ``EngineConfig`` keywords these arguments give (the layout apart)."""
        kwargs = dict(dtype=self.dtype, max_model_len=self.max_model_len, seed=self.seed, kv_transfer=self.kv_transfer,
                      kv_cache_bytes=self.kv_cache_bytes, threads_per_worker=self.threads_per_worker,
                      step_timeout_s=self.step_timeout_s, worker_start_timeout_s=self.start_timeout_s,
                      max_worker_restarts=self.max_worker_restarts, restart_window_s=self.restart_window_s,
                      numerics=self.numerics, async_scheduling=self.async_scheduling, device=self.resolved_device(),
                      enforce_eager=self.enforce_eager)
        kwargs.update({name: getattr(self, name) for name in _OPTIONAL if getattr(self, name) is not None})
        if self.speculative or self.speculative_history:
            kwargs["speculative"] = {"history": self.speculative_history}
        if self.profile:
            kwargs["profile_table"] = self.profile
        return kwargs

    def build(self) -> Engine:
        """Start the engine and install the switch schedule (the controller comes with ``profile_table``)."""
        if self.profile and self.switch_schedule:
            raise InvalidRequestError("give either --profile (the controller) or --switch-schedule, not both")
        layout = self.layout()
        if self.switch_schedule:  # refuse a bad schedule before starting any worker
            for _, tp in self.switch_schedule:
                Layout.for_world(layout.world, tp)
        engine = Engine(self.model, tp=layout.tp, dp=layout.dp, **self.engine_kwargs())
        try:
            if self.switch_schedule:  # e.g. a tp larger than the number of heads is refused here
                kv = None if self.kv_transfer == "auto" else self.kv_transfer
                engine.set_policy(engine.scheduled_policy(list(self.switch_schedule), kv))
        except LayoutError as exc:
            engine.shutdown()
            raise LayoutError(f"--switch-schedule: {exc}") from None
        except BaseException:
            engine.shutdown()
            raise
        return engine


# EngineConfig fields whose flag may be left out (EngineConfig's default then stands)
_OPTIONAL = ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "block_size",
             "attention_backend", "switch_keeps_prefix_cache", "max_tp", "tokenizer", "chat_template")


def _default(field: str) -> str:
    """EngineConfig's default for ``field``, for a flag's help (the config is its one home)."""
    value = EngineConfig.__dataclass_fields__[field].default
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def add_engine_args(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", required=model_required, help="Hugging Face checkpoint directory")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="Hugging Face tokenizer directory (default: the model's)")
    g.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="a Jinja chat template, or the path of a file holding one, used in place of the "
                        "tokenizer's (checked at start-up)")
    g.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="base tensor-parallel degree (default 1)")
    g.add_argument("--dp", "--data-parallel-size", dest="dp", type=int, default=None,
                   help="base data-parallel degree (default: world / tp, or 1)")
    g.add_argument("--world", type=int, default=None,
                   help="ranks in all (GPUs, or CPU worker processes); dp = world / tp")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="where the ranks run: cuda (one GPU each; more ranks than GPUs share them, a test mode), "
                        "cpu (worker processes), auto: cuda when torch sees a GPU (default)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="share of each GPU the engine's ranks on it may use together "
                        f"(default {_default('gpu_memory_utilization')})")
    g.add_argument("--enforce-eager", action="store_true", help="capture no CUDA graphs (every step eager)")
    g.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help=f"requests running at once per DP group (default {_default('max_num_seqs')})")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="tokens per prefill step and DP group (default "
                        + ", ".join(f"{n} on {d}" for d, n in PREFILL_STEP_TOKENS.items()) + ")")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of full blocks of earlier prompts with the same prefix "
                        f"(default {_default('enable_prefix_caching')})")
    g.add_argument("--block-size", type=int, default=None, metavar="N",
                   help=f"tokens per KV block (default {_default('block_size')})")
    g.add_argument("--attention-backend", choices=BACKEND_NAMES, default=None,
                   help="attention kernels (default auto: Triton on CUDA, torch and the C++ decode kernel on the "
                        "CPU; docs/attention.md)")
    g.add_argument("--dtype", default="auto", help="float64, float32, bfloat16, float16 or auto (the checkpoint's)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--kv-cache-bytes", type=int, default=None, help="KV cache bytes per rank (CPU default: a quarter of the available memory over the ranks, at most what max_num_seqs full-length requests use)")
    g.add_argument("--seed", type=int, default=0, help="engine seed for requests that give none")
    sw = g.add_mutually_exclusive_group()
    sw.add_argument("--profile", metavar="TABLE", default=None,
                    help="latency table from pat-profile: the controller decides when to switch")
    sw.add_argument("--switch-schedule", type=parse_schedule, default=None, metavar="STEP:TP,...",
                    help='fixed switches, e.g. "32:4,64:2": TP4 at decode step 32, TP2 at step 64')
    g.add_argument("--kv-transfer", choices=("auto", "migrate", "recompute"), default="auto",
                   help="how switches move the KV cache (auto: the cost model picks)")
    g.add_argument("--switch-keeps-prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="a migrating switch also moves the cached prefixes no request holds, for later turns "
                        f"(default {_default('switch_keeps_prefix_cache')})")
    g.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS,
                   help="invariant: the same bits at every layout and across live switches; fast: the layout "
                        "decides the rounding (docs/numerics.md)")
    g.add_argument("--max-tp", type=int, default=None, metavar="N",
                   help="with --numerics invariant: the largest TP any deployment of this model may use, a power "
                        "of two; engines and reference_logprobs agree bit for bit when they declare the same "
                        f"(default {_default('max_tp')})")
    g.add_argument("--speculative", action="store_true",
                   help="speculative decoding of small batches without a draft model; exact with --numerics "
                        "invariant or float64 (docs/speculative.md)")
    g.add_argument("--speculative-history", action="store_true",
                   help="with --speculative: also draft from earlier responses to the same prompt")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="send each decode step before the one in flight is answered, so the device does not "
                        "wait for the driver between steps (vLLM's flag; docs/async_scheduling.md; default: on "
                        "on a GPU, off on the CPU)")
    g.add_argument("--threads-per-worker", type=int, default=None, help="torch threads per worker (CPU)")
    f = p.add_argument_group("failures")
    f.add_argument("--step-timeout", type=float, default=600.0, metavar="S",
                   help="a step (or a stopped/hung worker) taking longer than S seconds is a failure: the workers "
                        "are restarted and the requests recomputed (default 600)")
    f.add_argument("--start-timeout", type=float, default=300.0, metavar="S",
                   help="seconds workers may take to start and load the model (default 300)")
    f.add_argument("--max-worker-restarts", type=int, default=4, metavar="N",
                   help="restarts allowed within --restart-window; one more and the engine stops serving "
                        "(pat-serve serve then exits with status 1) (default 4)")
    f.add_argument("--restart-window", type=float, default=300.0, metavar="S",
                   help="the sliding window of --max-worker-restarts, seconds (default 300)")
