"""``PatRolloutActor``: the methods of OpenRLHF's ``RolloutRayActor``, served by a pat-engine.

OpenRLHF's driver calls, on every engine actor: ``init_process_group`` once,
then per step ``wake_up`` / ``generate_responses`` (or ``generate`` from an
agent executor) / ``sleep``, ``get_num_unfinished_requests`` for load
balancing, and for weight sync ``update_weight(name, dtype, shape)`` followed
by a broadcast from the trainer (gloo: this actor receives; nccl: every worker joins OpenRLHF's
PyNccl group on its GPU), or, colocated, ``update_weight_cuda_ipc`` with one handle per trainer GPU
(each worker opens its own GPU's). Colocated, ``bundle_indices`` seat the engine's ranks on the
bundles of OpenRLHF's shared placement group, rank ``r`` on the GPU of ``bundle_indices[r]``
(``openrlhf.colocate``). Signatures follow OpenRLHF 0.11.2. With ``pat_rollout``
(tail batching, group sizing), ``rollout_step`` runs a step's prompts as one tail-batched round
(``pat_integrations.rounds``): a drop-in for the sample generation of a step.
Wrapped with ``ray.remote`` by ``create_pat_engines``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from typing import Any

import torch

from pat_engine import Engine
from pat_integrations.frontend import AsyncEngineFrontend, LayoutViews
from pat_integrations.openrlhf.colocate import seat_engine
from pat_integrations.openrlhf.outputs import GenerationOutput, to_vllm_shape
from pat_integrations.openrlhf.settings import PatActorSettings
from pat_engine.model.weight_handles import DeviceHandles, serialize, serialize_reduced
from pat_engine.parallel.update_group import STATELESS_NCCL
from pat_integrations.openrlhf.weight_sync import LocalRanks
from pat_integrations.reward_conventions import openrlhf_reward
from pat_integrations.rollout_options import reward_config
from pat_integrations.rounds import EngineRounds, RoundResult, token_prompts
from pat_integrations.sampling import from_vllm_like

log = logging.getLogger(__name__)

WEIGHT_BUCKET_BYTES = 256 << 20  # received tensors are applied in buckets of about this size


def _load_agent_executor(path: str):
    """OpenRLHF's rule: a .py file defining ``AgentExecutor`` (an ``AgentExecutorBase``)."""
    if not path.endswith(".py"):
        raise ValueError(f"agent_func_path must be a Python file, got {path!r}")
    spec = importlib.util.spec_from_file_location("pat_agent_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    executor_cls = getattr(module, "AgentExecutor", None)
    if executor_cls is None:
        raise ValueError(f"{path} defines no AgentExecutor class")
    try:
        from openrlhf.utils.agent import AgentExecutorBase
    except ImportError:  # OpenRLHF absent: accept any class with OpenRLHF's execute() signature
        AgentExecutorBase = None
    if AgentExecutorBase is not None and not issubclass(executor_cls, AgentExecutorBase):
        raise TypeError("AgentExecutor must inherit from openrlhf.utils.agent.AgentExecutorBase")
    return executor_cls()


class PatRolloutActor(LayoutViews):
    def __init__(self, *args: Any, bundle_indices: list | None = None, agent_func_path: str | None = None,
                 remote_rm_url: str | None = None, mm_pad_token_ids: set | None = None, **kwargs: Any):
        if args:
            raise TypeError("pass engine arguments by name (as OpenRLHF's create_vllm_engines does)")
        # colocated (OpenRLHF's shared placement group): rank r on bundle_indices[r], its GPU
        self._seats = seat_engine(bundle_indices, int(kwargs.get("tensor_parallel_size", 1))) \
            if bundle_indices is not None else None
        try:
            self.settings = PatActorSettings.from_vllm_kwargs(kwargs)
            s = self.settings
            self.engine = Engine(s.model, tp=s.tp, dp=s.dp, **s.engine_kwargs)
        except BaseException:
            if self._seats is not None:
                self._seats.release()
            raise
        self.frontend = AsyncEngineFrontend(self.engine, s.plan)
        self.rounds = EngineRounds(self.engine, s.rollout, s.plan, seed=int(s.engine_kwargs.get("seed") or 0),
                                   name="openrlhf") if s.rollout is not None else None
        self._executor = _load_agent_executor(agent_func_path) if agent_func_path else None
        self._remote_rm_url = remote_rm_url
        self._update_group: LocalRanks | None = None  # gloo: this actor holds the engine's ranks
        self._nccl_group: str | None = None  # nccl: the workers joined the group named so
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._pending_bytes = 0

    # ---- generation ---------------------------------------------------------------------

    async def generate(self, prompt_token_ids: list[int], sampling_params: Any,
                       multi_modal_data: Any = None) -> GenerationOutput:
        if multi_modal_data:
            raise NotImplementedError("pat-engine serves text-only models: multi_modal_data is not supported")
        await self._apply_pending()
        prompt = [int(t) for t in prompt_token_ids]
        max_len = self.engine.max_model_len
        params = from_vllm_like(sampling_params, default_max_tokens=max_len - len(prompt),
                                logprobs_mode=self.settings.logprobs_mode)
        out = await self.frontend.generate(prompt, params)
        tokenizer = self.engine.tokenizer
        if tokenizer is None or params.stop:  # the engine's text: stop strings cut it where one matched
            return to_vllm_shape(out)
        skip = getattr(sampling_params, "skip_special_tokens", True)
        return to_vllm_shape(out, lambda ids: tokenizer.decode(ids, skip_special_tokens=skip))

    async def rollout_step(self, prompts: list[tuple], sampling_params: Any,
                           reward_options: dict[str, Any] | None = None) -> RoundResult:
        """One RL step as a tail-batched round over this step's fresh (uid, prompt token ids), or (uid, prompt
        token ids, label); the result's groups hold ``vllm.RequestOutput``-shaped outputs (one sample each),
        ``wants`` how many fresh prompts to send next time. ``sampling_params``: the step's
        ``vllm.SamplingParams`` with ``n=1`` (responses per prompt come from ``pat_rollout``). With
        ``remote_rm_url`` (OpenRLHF's reward: a ``reward_func`` file or reward-model URLs) each response is
        scored as it finishes, while the round still generates, and ``result.rewards`` holds the results
        group by group (``reward_conventions.py``); ``reward_options``: ``RewardConfig`` fields."""
        if self.rounds is None:
            raise RuntimeError("rollout_step needs pat_rollout with tail_batching or group_sizing")
        await self._apply_pending()
        prompts = token_prompts(prompts, lambda label: {"label": label})
        longest = max((len(p[1]) for p in prompts), default=0)
        params = from_vllm_like(sampling_params, default_max_tokens=self.engine.max_model_len - longest,
                                logprobs_mode=self.settings.logprobs_mode)
        fn = openrlhf_reward(self._remote_rm_url, self.engine.tokenizer) if self._remote_rm_url else None
        res = await self.frontend.exclusive(self.rounds.step, prompts, params, fn, reward_config(reward_options))
        return res.with_outputs(to_vllm_shape)

    def get_num_unfinished_requests(self) -> int:
        return self.frontend.num_in_flight

    async def generate_responses(self, prompt: str, label: str, sampling_params: Any, max_length: int,
                                 hf_tokenizer: Any, num_samples: int = 1, images: Any = None) -> list[dict]:
        """OpenRLHF's per-prompt rollout: its agent executor, with this actor as the engine."""
        if self._executor is None:
            try:
                from openrlhf.utils.agent import SingleTurnAgentExecutor
            except ImportError as exc:
                raise ImportError("generate_responses without agent_func_path uses OpenRLHF's "
                                  "SingleTurnAgentExecutor: install openrlhf") from exc
            self._executor = SingleTurnAgentExecutor(self._remote_rm_url)
        return list(await asyncio.gather(*[
            self._executor.execute(prompt=prompt, label=label, sampling_params=sampling_params,
                                   max_length=max_length, hf_tokenizer=hf_tokenizer, llm_engine=self, images=images)
            for _ in range(num_samples)
        ]))

    async def pause_generation(self) -> None:
        """vLLM's mode="keep": stop stepping, keep requests and their KV."""
        await self.frontend.call(self.engine.pause)

    async def resume_generation(self) -> None:
        await self.frontend.call(self.engine.resume)

    # ---- memory -------------------------------------------------------------------------

    async def sleep(self, level: int = 1) -> None:
        await self._apply_pending()
        await self.frontend.sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.frontend.wake_up(tags)

    async def reset_prefix_cache(self) -> None:
        self.engine.flush_cache()

    # ---- weights -----------------------------------------------------------------------------

    async def init_process_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 group_name: str, backend: str = "nccl", use_ray: bool = False) -> None:
        """``backend="nccl"``: OpenRLHF's trainer builds vLLM's StatelessProcessGroup + PyNccl, so every
        worker joins that kind of group on its own GPU (vLLM must be installed; CUDA engines only).
        ``backend="gloo"``: this actor holds the engine's ranks (the trainer uses ``stateless_gloo_group``)."""
        if use_ray:
            raise NotImplementedError("use_ray=True (ray.util.collective) puts one rank in each process; "
                                      "a pat engine holds all its ranks in one actor: use the default path")
        world = self.engine.config.world
        if backend == "nccl":
            if self.engine.config.device != "cuda":
                raise ValueError(
                    "backend='nccl' needs a pat engine on CUDA devices (each worker joins OpenRLHF's vLLM "
                    "StatelessProcessGroup + PyNccl group on its GPU); this engine runs on CPU: use backend='gloo' "
                    "with pat_integrations.openrlhf.weight_sync.stateless_gloo_group on the trainer side")
            await self.frontend.call(self.engine.init_weights_update_group, master_address, master_port, rank_offset,
                                     world_size, group_name, STATELESS_NCCL)
            self._nccl_group = group_name
            return
        if backend != "gloo":
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        self._update_group = await LocalRanks.join(master_address, master_port, rank_offset, world_size,
                                                   group_name, world)

    async def update_weight(self, name: str, dtype: torch.dtype, shape: Any, empty_cache: bool = False) -> None:
        if self._nccl_group is not None:  # the workers take part in the broadcast on their own GPUs
            await self.frontend.call(self.engine.update_weights_from_distributed, [name], [str(dtype)],
                                     [list(shape)], self._nccl_group, final=empty_cache)
            self._weights_changed(empty_cache)
            return
        if self._update_group is None:
            raise RuntimeError("update_weight before init_process_group")
        tensor = await self._update_group.receive(dtype, tuple(shape))
        self._pending.append((name, tensor))
        self._pending_bytes += tensor.numel() * tensor.element_size()
        # OpenRLHF marks its last parameter with empty_cache=True; buckets bound the memory held meanwhile
        if empty_cache or self._pending_bytes >= WEIGHT_BUCKET_BYTES:
            await self._apply_pending()

    async def update_weight_cuda_ipc(self, name: str, dtype: torch.dtype, shape: Any, ipc_handles: dict,
                                     empty_cache: bool = False) -> None:
        """OpenRLHF's colocated sync: ``ipc_handles`` maps each trainer GPU (``get_physical_gpu_id``, its
        UUID) to ``reduce_tensor`` of the full parameter there; every worker opens the handle on its own
        GPU (on CPU: key "cpu", shared memory) and copies its shard. The trainer frees its copy once this
        returns, so the parameter is applied now; the last one (``empty_cache``) counts the version."""
        await self._apply_pending()
        payload = serialize([(name, DeviceHandles({str(k): serialize_reduced(h) for k, h in ipc_handles.items()}))])
        await self.frontend.call(self.engine.update_weights_from_handles, payload, final=empty_cache)
        self._weights_changed(empty_cache)

    async def _apply_pending(self) -> None:
        if self._pending:
            bucket, self._pending, self._pending_bytes = self._pending, [], 0
            await self.frontend.call(self.engine.update_weights, bucket)
            self._weights_changed(True)

    def _weights_changed(self, whole: bool) -> None:
        if whole and self.rounds is not None:
            self.rounds.weights_updated()  # deferred partials are now stale: regenerated, not resumed

    # ---- introspection (not part of OpenRLHF's contract) ---------------------------------------

    def num_switches(self) -> int:
        return len(self.engine.switches)

    def prefix_cache_stats(self) -> dict:
        return self.engine.prefix_cache_stats()

    def placement(self) -> dict:
        """Where the ranks sit when colocated: bundles, GPU ids and node, rank by rank; and the workers' pids."""
        seats = self._seats
        where = {"bundles": seats.bundles, "gpu_ids": seats.gpu_ids, "node_id": seats.node_id} if seats else {}
        return {**where, "worker_pids": self.engine.worker_pids()}

    def is_sleeping(self) -> bool:
        return self.engine.sleeping

    def shutdown(self) -> None:
        if self._update_group is not None:
            self._update_group.close()
        if self.rounds is not None:
            self.rounds.close()  # the reward stage's threads and running verifiers end with the engine
        self.engine.shutdown()
        if self._seats is not None:
            self._seats.release()
