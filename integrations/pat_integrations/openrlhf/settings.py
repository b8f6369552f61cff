"""From the vLLM engine arguments OpenRLHF passes to its rollout actor, to a pat-engine.

``tensor_parallel_size`` is the number of devices of one engine, as in
OpenRLHF's placement. The engine starts each stage at ``pat_base_tp``
(default: ``tensor_parallel_size``, i.e. vLLM's layout) with
``tensor_parallel_size / pat_base_tp`` DP groups, and may switch on
``pat_switch_schedule`` or its controller (``pat_engine_kwargs.profile_table``).
``pat_rollout``: the rollout policies (``pat_integrations.rollout_options``: ``responses_per_step``,
``group_size`` = OpenRLHF's ``n_samples_per_prompt``, ``tail_batching``, ``group_sizing``) that the
actor's ``rollout_step`` runs.
``enable_prefix_caching`` goes to the engine as it is (False: every prompt is prefilled in full), and
so does ``enforce_eager`` (True: no CUDA graphs; on the CPU there are none either way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pat_engine.config import auto_device
from pat_engine.rollout.config import RolloutConfig
from pat_integrations.rollout_options import KEYS as ROLLOUT_KEYS
from pat_integrations.rollout_options import rollout_config
from pat_integrations.stage import StagePlan

# vLLM arguments about placement and vLLM internals: handled by Ray or meaningless for pat-engine.
IGNORED = {"worker_extension_cls", "distributed_executor_backend", "trust_remote_code", "num_gpus",
           "bundle_indices", "max_logprobs", "enable_sleep_mode"}


@dataclass(frozen=True)
class PatActorSettings:
    model: str
    tp: int
    dp: int
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    plan: StagePlan = StagePlan()
    max_model_len: int | None = None
    logprobs_mode: str = "raw"  # "raw" (vLLM's raw_logprobs) or "processed" (processed_logprobs)
    rollout: RolloutConfig | None = None  # tail batching / group sizing for rollout_step; None: off

    @classmethod
    def from_vllm_kwargs(cls, kwargs: dict[str, Any]) -> "PatActorSettings":
        kw = dict(kwargs)
        model = kw.pop("model")
        devices = int(kw.pop("tensor_parallel_size", 1))
        base_tp = int(kw.pop("pat_base_tp", None) or devices)
        if devices % base_tp:
            raise ValueError(f"pat_base_tp={base_tp} must divide tensor_parallel_size={devices}")
        engine_kwargs: dict[str, Any] = {}
        for name in ("seed", "max_model_len", "dtype", "gpu_memory_utilization", "enable_prefix_caching",
                     "enforce_eager"):  # enforce_eager: no CUDA graphs, as in vLLM
            if kw.get(name) is not None:
                engine_kwargs[name] = kw[name]
            kw.pop(name, None)
        kw.pop("full_determinism", None)  # pat sampling is always reproducible (per-request seed and position)
        mode = kw.pop("logprobs_mode", None) or "raw_logprobs"
        if mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"logprobs_mode={mode!r}: pat-engine returns raw_logprobs (log-softmax of the model's "
                             "logits) or processed_logprobs (after temperature, top-k and top-p)")
        if kw.pop("limit_mm_per_prompt", None):
            raise ValueError("pat-engine serves text-only models (limit_mm_per_prompt given)")
        for name in IGNORED:
            kw.pop(name, None)
        plan = StagePlan.from_options(kw.pop("pat_switch_schedule", None))
        rollout = kw.pop("pat_rollout", None) or {}
        if not isinstance(rollout, dict) or set(rollout) - ROLLOUT_KEYS:
            raise ValueError(f"pat_rollout must be a dict with keys among {sorted(ROLLOUT_KEYS)}, got {rollout!r}")
        if rollout and "group_size" not in rollout and not rollout.get("group_sizing"):
            raise ValueError("pat_rollout.group_size is required: OpenRLHF's n_samples_per_prompt")
        engine_kwargs.update(kw.pop("pat_engine_kwargs", None) or {})
        if kw:
            raise TypeError(f"unsupported engine argument(s) for pat-engine: {sorted(kw)}")
        engine_kwargs.setdefault("device", auto_device())
        return cls(str(model), base_tp, devices // base_tp, engine_kwargs, plan, engine_kwargs.get("max_model_len"),
                   mode.removesuffix("_logprobs"), rollout_config(rollout, None, "pat_rollout"))
