"""``NodeEngine``: the Ray actor body that owns one node's pat-engine.

The engine's worker processes are children of this actor, on its node, so
tensor parallelism never crosses a node. Each node starts its stages from its
own base layout and switches on its own schedule (or controller), or live on
``reconfigure``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from pat_engine import Engine, RequestOutput, SamplingParams
from pat_integrations.frontend import AsyncEngineFrontend, LayoutViews
from pat_integrations.stage import StagePlan


class NodeEngine(LayoutViews):
    def __init__(self, model: str, tp: int, dp: int, engine_kwargs: dict[str, Any] | None = None,
                 plan: StagePlan | None = None):
        self.engine = Engine(model, tp=tp, dp=dp, **(engine_kwargs or {}))
        self.frontend = AsyncEngineFrontend(self.engine, plan)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    async def generate_batch(self, prompts: list[Any], params: list[SamplingParams],
                             request_ids: list[str] | None = None, plan: StagePlan | None = None) -> list[RequestOutput]:
        outs = await self.frontend.generate_batch(prompts, params, request_ids, plan)
        assert outs is not None  # this actor never closes its gate
        return outs

    async def reconfigure(self, tp: int) -> dict:
        event = await self.frontend.call(self.engine.reconfigure, tp)
        return asdict(event)

    def num_unfinished_requests(self) -> int:
        return self.frontend.num_in_flight

    async def update_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        await self.frontend.drain()
        return await self.frontend.update_weights(bucket)

    async def sleep(self, level: int = 1) -> int:
        return await self.frontend.sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.frontend.wake_up(tags)

    def shutdown(self) -> None:
        self.engine.shutdown()
