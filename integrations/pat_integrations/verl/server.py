"""``PatServer``: the veRL rollout server actor body, serving one pat-engine.

veRL's load balancer calls ``generate`` (token ids in, ``TokenOutput`` out);
its replica and checkpoint manager call the memory and gate methods below;
``PatServerAdapter`` (trainer side) streams weight buckets into
``update_weights_bucket``. A request that finds the engine idle starts a new
generation stage from the base layout (see ``pat_integrations.stage``).

Partial rollout: an aborted request's answer is recorded so that veRL's resubmission
(prompt + tokens so far, ``FullyAsyncLLMServerClient``) continues it exactly
(``pat_integrations.partials``). With ``engine_kwargs.pat.tail_batching`` / ``group_sizing``,
``rollout_step`` runs one RL step's prompts as a tail-batched round (``pat_integrations.rounds``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from verl.workers.rollout.replica import RolloutMode, TokenOutput

from pat_engine import Engine
from pat_integrations.frontend import AsyncEngineFrontend, LayoutViews
from pat_integrations.partials import PartialLedger
from pat_integrations.ray_cluster.placement import expose_gpus
from pat_integrations.reward_conventions import verl_reward
from pat_integrations.rollout_options import reward_config
from pat_integrations.rounds import EngineRounds, RoundResult, token_prompts
from pat_integrations.sampling import from_verl
from pat_integrations.verl.outputs import token_output
from pat_integrations.verl.settings import PatRolloutSettings

log = logging.getLogger(__name__)


class PatServer(LayoutViews):
    def __init__(self, config: Any, model_config: Any, rollout_mode: RolloutMode, replica_rank: int,
                 devices_per_node: int, visible_devices: str | None = None):
        if visible_devices:  # the hybrid workers' GPUs: the engine's worker processes inherit them
            expose_gpus(visible_devices.split(","))
        self.settings = PatRolloutSettings.from_verl(config, model_config, devices_per_node)
        self.free_cache_engine = bool(config.free_cache_engine)
        self.rollout_mode = rollout_mode
        self.replica_rank = replica_rank
        s = self.settings
        self.engine = Engine(s.model, tp=s.tp, dp=s.dp, **s.engine_kwargs)
        self.frontend = AsyncEngineFrontend(self.engine, s.plan)
        self.global_steps: int | None = None
        self.partials = PartialLedger(int(s.engine_kwargs.get("seed") or 0))
        self._weight_buckets = {"handles": 0, "values": 0}  # how the weight buckets arrived, counted
        self._handle_update_open = False  # handle buckets in, the version not yet counted
        self.rounds = EngineRounds(self.engine, s.rollout, s.plan, seed=int(s.engine_kwargs.get("seed") or 0),
                                   name=f"verl{replica_rank}") if s.rollout is not None else None

    def get_server_address(self) -> str:
        """The load balancer's key for this replica (pat serves over Ray, not HTTP)."""
        import ray

        return f"pat://{ray.util.get_node_ip_address()}/replica-{self.replica_rank}"

    # ---- generation ---------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, **kwargs: Any) -> TokenOutput:
        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise NotImplementedError("pat-engine serves text-only models: image/video/audio data is not supported")
        prompt_ids = [int(t) for t in prompt_ids]
        s = self.settings
        params = from_verl(s.within_context(sampling_params, len(prompt_ids)), s.default_max_tokens(len(prompt_ids)),
                           defaults=s.sampling_defaults)
        params, origin = self.partials.prepare(prompt_ids, params, request_id)
        out = await self.frontend.generate(prompt_ids, params, request_id)
        self.partials.settle(origin, out)
        return token_output(out, params.prompt_logprobs, self.global_steps)

    async def rollout_step(self, prompts: list[tuple], sampling_params: dict[str, Any],
                           reward: Any = None, reward_options: dict[str, Any] | None = None) -> RoundResult:
        """One RL step as a tail-batched round: ``prompts`` are this step's fresh (uid, prompt ids), or
        (uid, prompt ids, fields) with the dataset row's fields (``data_source``, ``reward_model``,
        ``extra_info``); the result's groups hold ``TokenOutput``s (in finish order;
        ``extra_fields["sample_index"]`` is the response's index within its prompt, which its seed depends
        on); ``wants``: how many to send next time. ``reward``: veRL's ``custom_reward_function``
        (``{"path", "name", "reward_kwargs"}``; no path: veRL's ``default_compute_score``) or a
        ``compute_score`` callable: each response is scored as it finishes, while the round still generates,
        and ``result.rewards`` holds the results group by group (``reward_conventions.py``);
        ``reward_options``: ``RewardConfig`` fields (workers, timeouts)."""
        if self.rounds is None:
            raise RuntimeError("rollout_step needs rollout.engine_kwargs.pat.tail_batching or .group_sizing")
        s = self.settings
        prompts = token_prompts(prompts)  # veRL's row fields are the metadata
        longest = max((len(p[1]) for p in prompts), default=0)
        params = from_verl(sampling_params, s.default_max_tokens(longest), defaults=s.sampling_defaults)
        fn = verl_reward(reward) if reward is not None else None
        res = await self.frontend.exclusive(self.rounds.step, prompts, params, fn, reward_config(reward_options))
        return res.with_outputs(lambda out: token_output(out, params.prompt_logprobs, self.global_steps,
                                                         sample_index=out.sample_index))

    # ---- gate --------------------------------------------------------------------------

    async def abort_all_requests(self, reject_request: bool = False, **_: Any) -> dict[str, Any]:
        ids = await self.frontend.abort_all(reject=reject_request)
        return {"aborted_count": len(ids), "request_ids": ids}

    async def resume_generation(self) -> None:
        self.frontend.reopen()

    async def wait_for_requests_to_drain(self) -> None:
        await self.frontend.drain()

    # ---- memory -------------------------------------------------------------------------

    async def sleep(self) -> None:
        if not self.free_cache_engine or self.rollout_mode == RolloutMode.STANDALONE:
            return
        await self.frontend.sleep(self.settings.sleep_level if self.rollout_mode == RolloutMode.HYBRID else 1)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.frontend.wake_up(tags)

    async def release_kv_cache(self) -> None:
        """Free only the KV cache (around a checkpoint-engine weight sync)."""
        if self.free_cache_engine:
            await self.frontend.sleep(tags=["kv_cache"])

    async def resume_kv_cache(self) -> None:
        await self.frontend.wake_up(["kv_cache"])

    async def clear_kv_cache(self) -> None:
        self.engine.flush_cache()  # drop the prefix cache: KV computed under old weights is not reused

    # ---- weights ----------------------------------------------------------------------------

    async def update_weights_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        await self.frontend.drain()
        self._weight_buckets["values"] += 1
        return await self.frontend.update_weights(bucket)

    async def update_weights_handles(self, payloads: list[bytes]) -> int:
        """One bucket by handle, one payload per engine worker (or one for all); the version is counted
        by ``finish_weight_update``, once the last bucket is in."""
        await self.frontend.drain()
        self._handle_update_open = True
        self._weight_buckets["handles"] += 1
        return await self.frontend.call(self.engine.update_weights_from_handles, [payloads], final=False)

    async def finish_weight_update(self, global_steps: int | None = None) -> None:
        if self._handle_update_open:
            self._handle_update_open = False
            await self.frontend.call(self.engine.update_weights_from_handles, [], final=True)  # count the version
        self.engine.flush_cache()
        if self.rounds is not None:
            self.rounds.weights_updated()  # deferred partials are now stale: regenerated, not resumed
        if global_steps is not None:
            self.global_steps = global_steps

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # ---- profiling and introspection ----------------------------------------------------------

    async def start_profile(self, **kwargs: Any) -> None:
        log.info("pat server: start_profile ignored (profile pat-engine with pat-profile)")

    async def stop_profile(self) -> None:
        return None

    def weight_bucket_counts(self) -> dict:
        """Weight buckets received so far, by way: ``handles`` or ``values`` (Ray's object store)."""
        return dict(self._weight_buckets)

    def is_sleeping(self) -> bool:
        return self.engine.sleeping

    def num_unfinished_requests(self) -> int:
        return self.frontend.num_in_flight

    def shutdown(self) -> None:
        if self.rounds is not None:
            self.rounds.close()  # the reward stage's threads and running verifiers end with the engine
        self.engine.shutdown()
