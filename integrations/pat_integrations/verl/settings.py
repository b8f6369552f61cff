"""From veRL's rollout config to a pat-engine: layout, engine options and stage plan.

veRL's ``tensor_model_parallel_size`` is the base TP of the engine and
``data_parallel_size`` its base DP, so one replica is one engine of
``tp * dp`` devices. Extra options come from
``actor_rollout_ref.rollout.engine_kwargs.pat`` (Hydra: ``+...engine_kwargs.pat.KEY=VALUE``):
any ``pat_engine.config.EngineConfig`` field, plus ``switch_schedule``
(``[[decode_step, tp], ...]``, applied afresh in every stage) and
``sleep_level`` (what ``sleep()`` releases in hybrid mode; default 2 like vLLM) and the
rollout policies of ``pat_integrations.rollout_options`` (``tail_batching``, ``group_sizing``,
``responses_per_step``, ``group_size``; R0 defaults to ``rollout.n``), which ``PatServer.rollout_step`` runs;
``weight_transfer`` (``auto``, ``handles``, ``object_store``: how ``PatServerAdapter`` sends weights).
``enable_prefix_caching`` and ``enforce_eager`` (True: no CUDA graphs) go to the engine; the config's
``repetition_penalty`` and ``ignore_eos`` are defaults for requests that leave them out, as veRL's
vLLM server has them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from pat_engine.config import EngineConfig, auto_device
from pat_engine.rollout.config import RolloutConfig
from pat_integrations.rollout_options import KEYS as ROLLOUT_KEYS
from pat_integrations.rollout_options import rollout_config
from pat_integrations.stage import StagePlan

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "tp", "dp"}
_OWN_KEYS = {"switch_schedule", "sleep_level", "weight_transfer"} | ROLLOUT_KEYS
WEIGHT_TRANSFERS = ("auto", "handles", "object_store")  # how PatServerAdapter sends weight buckets


def _plain(value: Any) -> Any:
    """OmegaConf containers to plain Python (configs arrive as DictConfig or as dataclass fields)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - veRL always brings omegaconf
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def model_path(model_config: Any) -> str:
    """The local checkpoint directory from veRL's model config (dataclass or DictConfig)."""
    for key in ("local_path", "path"):
        value = getattr(model_config, key, None)
        if value is None and hasattr(model_config, "get"):
            value = model_config.get(key)
        if value:
            return str(value)
    raise ValueError("actor_rollout_ref.model has neither local_path nor path")


def weight_transfer(config: Any) -> str:
    """``engine_kwargs.pat.weight_transfer`` of a rollout config (see ``PatServerAdapter``)."""
    value = dict(_plain((_plain(config.engine_kwargs) or {}).get("pat") or {})).get("weight_transfer", "auto")
    if value not in WEIGHT_TRANSFERS:
        raise ValueError(f"rollout.engine_kwargs.pat.weight_transfer must be one of {WEIGHT_TRANSFERS}, got {value!r}")
    return value


@dataclass(frozen=True)
class PatRolloutSettings:
    model: str
    tp: int
    dp: int
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    plan: StagePlan = StagePlan()
    sleep_level: int = 2
    rollout: RolloutConfig | None = None  # tail batching / group sizing for rollout_step; None: off
    prompt_length: int = 512
    response_length: int = 512
    max_model_len: int = 1024
    # what veRL's vLLM server takes from the rollout config when a request leaves it out
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_verl(cls, config: Any, model_config: Any, devices_per_node: int) -> "PatRolloutSettings":
        tp, dp = config.tensor_model_parallel_size, config.data_parallel_size
        if config.pipeline_model_parallel_size != 1:
            raise ValueError("pat-engine has no pipeline parallelism: set rollout.pipeline_model_parallel_size=1")
        if tp * dp > devices_per_node:
            raise ValueError(
                f"a pat replica is one engine inside one node (TP inside a node, DP across nodes), but "
                f"tensor_model_parallel_size * data_parallel_size = {tp * dp} > {devices_per_node} devices per node; "
                "lower data_parallel_size: veRL then runs more replicas and its load balancer spreads requests "
                "over them (DP across nodes)")
        for name in ("quantization", "enable_rollout_routing_replay"):
            if getattr(config, name, None):
                raise ValueError(f"rollout.{name} is not supported by pat-engine")
        extra = dict(_plain((_plain(config.engine_kwargs) or {}).get("pat") or {}))
        unknown = sorted(set(extra) - _ENGINE_FIELDS - _OWN_KEYS)
        if unknown:
            raise ValueError(f"unknown rollout.engine_kwargs.pat option(s) {unknown}; engine options are "
                             f"{sorted(_ENGINE_FIELDS)}, adapter options {sorted(_OWN_KEYS)}")
        max_len = config.max_model_len or config.prompt_length + config.response_length
        engine_kwargs: dict[str, Any] = {
            "dtype": config.dtype,
            "device": auto_device(),
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_model_len": max_len,
            "seed": config.seed,
            "enable_prefix_caching": bool(getattr(config, "enable_prefix_caching", True)),
            "enforce_eager": bool(getattr(config, "enforce_eager", False)),  # True: no CUDA graphs
        }
        engine_kwargs.update({k: v for k, v in extra.items() if k in _ENGINE_FIELDS})
        return cls(
            model=model_path(model_config), tp=tp, dp=dp, engine_kwargs=engine_kwargs,
            plan=StagePlan.from_options(extra.get("switch_schedule")),
            sleep_level=int(extra.get("sleep_level", 2)),
            rollout=rollout_config(extra, int(getattr(config, "n", 1) or 1), "rollout.engine_kwargs.pat"),
            prompt_length=config.prompt_length, response_length=config.response_length, max_model_len=max_len,
            sampling_defaults={name: getattr(config, name) for name in ("repetition_penalty", "ignore_eos")
                               if getattr(config, name, None) is not None},
        )

    def within_context(self, sampling_params: Mapping[str, Any], prompt_len: int) -> dict[str, Any]:
        """veRL's servers (vLLM's, SGLang's) clamp a request's ``max_tokens`` to the room its context leaves
        rather than refuse it: ``FullyAsyncLLMServerClient`` asks for ``response_length`` on every turn of
        a multi-turn rollout, whose later prompts leave less."""
        out = dict(sampling_params)
        for key in ("max_tokens", "max_new_tokens"):
            if out.get(key) is not None:
                out[key] = max(1, min(int(out[key]), self.max_model_len - prompt_len))
        return out

    def default_max_tokens(self, prompt_len: int) -> int:
        """veRL's rule when a request names no max_tokens: the response budget, within the context."""
        budget = min(self.response_length, self.prompt_length + self.response_length - prompt_len)
        return max(1, min(budget, self.max_model_len - prompt_len))
