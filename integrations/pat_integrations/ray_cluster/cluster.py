"""``RayClusterEngine``: the driver-side coordinator over one ``NodeEngine`` per node.

Requests go to the node with the fewest outstanding tokens (prompt plus
tokens still to generate, counted from assignment until the node returns).
Each node keeps its own layout: a per-node ``StagePlan`` or a live
``reconfigure(node, tp)`` switches one node while the others carry on.
Weights are broadcast bucket by bucket: each bucket is put in Ray's object
store once and every node reads it, so the full model is never held twice.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import ray
import torch

from pat_engine import InvalidRequestError, RequestOutput, SamplingParams
from pat_integrations.ray_cluster.node_engine import NodeEngine
from pat_integrations.ray_cluster.placement import alive_node_ids, pinned_to
from pat_integrations.stage import StagePlan

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass
class Assignment:
    """Which node served each request of the last ``generate`` call, in prompt order."""

    nodes: list[int] = field(default_factory=list)

    def counts(self, num_nodes: int) -> list[int]:
        return [self.nodes.count(n) for n in range(num_nodes)]


def _cost(prompt: Any, params: SamplingParams) -> int:
    prompt_len = len(prompt) if isinstance(prompt, (list, tuple)) else max(1, len(str(prompt)) // 4)
    return prompt_len + params.max_new_tokens


class RayClusterEngine:
    """One pat-engine of ``tp * dp`` devices on each of ``node_ids`` (default: every alive node)."""

    def __init__(self, model: str, tp: int = 1, dp: int = 1, node_ids: Sequence[str] | None = None,
                 plan: StagePlan | None = None, actor_options: dict[str, Any] | None = None, **engine_kwargs: Any):
        self.node_ids = list(node_ids) if node_ids is not None else alive_node_ids()
        if not self.node_ids:
            raise RuntimeError("no alive Ray node to place an engine on")
        remote_cls = ray.remote(NodeEngine)
        options = {"num_cpus": 0, **(actor_options or {})}
        self.actors = [
            remote_cls.options(**pinned_to(node, **options)).remote(model, tp, dp, engine_kwargs, plan)
            for node in self.node_ids
        ]
        placed = ray.get([a.node_id.remote() for a in self.actors])  # also waits for every engine to start
        if placed != self.node_ids:
            raise RuntimeError(f"engines landed on {placed}, expected {self.node_ids}")
        self._outstanding = [0] * len(self.actors)
        self._lock = threading.Lock()
        self.last_assignment = Assignment()

    @property
    def num_nodes(self) -> int:
        return len(self.actors)

    # ---- generation --------------------------------------------------------------------

    def _assign(self, costs: list[int]) -> list[int]:
        with self._lock:
            nodes = []
            for c in costs:
                node = min(range(self.num_nodes), key=lambda n: (self._outstanding[n], n))
                self._outstanding[node] += c
                nodes.append(node)
            return nodes

    def generate(self, prompts: Sequence[Any], params: SamplingParams | Sequence[SamplingParams],
                 plans: dict[int, StagePlan] | None = None,
                 request_ids: Sequence[str] | None = None) -> list[RequestOutput]:
        """Spread the prompts over the nodes and return outputs in prompt order.

        ``plans``: node index -> its stage plan (e.g. a switch schedule) for this batch.
        """
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        costs = [_cost(p, sp) for p, sp in zip(prompts, params)]
        nodes = self._assign(costs)
        refs, members = [], []
        for n in range(self.num_nodes):
            idx = [i for i, node in enumerate(nodes) if node == n]
            if not idx:
                continue
            ids = [request_ids[i] for i in idx] if request_ids else None
            plan = (plans or {}).get(n)
            refs.append(self.actors[n].generate_batch.remote([prompts[i] for i in idx], [params[i] for i in idx], ids, plan))
            members.append((n, idx))
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        try:
            for (n, idx), outs in zip(members, ray.get(refs)):
                for i, out in zip(idx, outs):
                    outputs[i] = out
        finally:
            with self._lock:
                for c, n in zip(costs, nodes):
                    self._outstanding[n] -= c
        self.last_assignment = Assignment(nodes)
        return outputs  # type: ignore[return-value]

    # ---- layouts -------------------------------------------------------------------------

    def reconfigure(self, node: int, tp: int) -> dict:
        """Switch one node live (mid-batch if it is generating); the others are untouched."""
        return ray.get(self.actors[node].reconfigure.remote(tp))

    def layouts(self) -> list[str]:
        return ray.get([a.layout.remote() for a in self.actors])

    def switches(self) -> list[list[dict]]:
        return ray.get([a.switches.remote() for a in self.actors])

    def stage_layouts(self) -> list[list[str]]:
        return ray.get([a.stage_layouts.remote() for a in self.actors])

    # ---- RL control ---------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        """Send full HF-named tensors to every node; returns how many tensors each node applied."""
        applied = 0
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in named_tensors:
            tensor = tensor.detach().cpu().contiguous()
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                applied += self._send(bucket)
                bucket, size = [], 0
        if bucket:
            applied += self._send(bucket)
        return applied

    def _send(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        ref = ray.put(bucket)  # stored once; every node reads the same object
        counts = ray.get([a.update_weights.remote(ref) for a in self.actors])
        if len(set(counts)) != 1:
            raise RuntimeError(f"nodes applied different numbers of tensors: {counts}")
        return counts[0]

    def sleep(self, level: int = 1) -> int:
        return sum(ray.get([a.sleep.remote(level) for a in self.actors]))

    def wake_up(self, tags: list[str] | None = None) -> None:
        ray.get([a.wake_up.remote(tags) for a in self.actors])

    def shutdown(self) -> None:
        for actor in self.actors:
            try:
                ray.get(actor.shutdown.remote(), timeout=60)
            except Exception:  # already gone: Ray reclaims it with the job
                pass
            ray.kill(actor)
        self.actors = []

    def __enter__(self) -> "RayClusterEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
