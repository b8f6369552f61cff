"""``AsyncEngineFrontend``: one pat-engine served to many concurrent asyncio callers.

The Ray actors of every adapter (veRL server, OpenRLHF actor, per-node cluster
engine) wrap an ``Engine`` in this class. It adds what an RL framework expects
from a rollout server around the plain engine API:

- stages: a request (or batch) that finds the engine idle starts a new
  generation stage, back at the base layout with a fresh switch policy, unless it
  is a later turn of a conversation answered in this stage (``turns.TurnLedger``:
  an agent rollout idles the engine while its tools run);
- turns on the DP group that holds their earlier turns' KV (``turns.PrefixAffinity``,
  installed when the engine caches prefixes);
- an admission gate: ``abort_all`` stops and aborts everything in flight and
  holds (or rejects) new requests until ``reopen``; aborted requests return
  what they generated with finish reason "abort";
- drain: wait until no request is in flight (before sleep or a weight update);
- sleep after a drain (the engine's own record of what is released makes a
  repeated sleep or a wake-up of an awake engine a no-op).

Blocking engine calls that can take long (a layout switch, a weight bucket,
sleep) run in a worker thread so the actor keeps serving its event loop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict
from typing import Any, Iterable, Sequence

import torch

from pat_engine import Engine, RequestHandle, RequestOutput, SamplingParams, WorkerFailure
from pat_integrations.async_bridge import await_samples
from pat_integrations.stage import StageCounter, StagePlan, begin_stage
from pat_integrations.turns import PrefixAffinity, TurnLedger

log = logging.getLogger(__name__)


class AsyncEngineFrontend:
    def __init__(self, engine: Engine, plan: StagePlan | None = None):
        self.engine = engine
        self.plan = plan or StagePlan()
        self.stages = StageCounter()
        self._handles: dict[tuple[str, int], RequestHandle] = {}  # by (request id, sample index)
        self._admit = asyncio.Lock()
        self._open = asyncio.Event()
        self._open.set()
        self._rejecting = False
        self._idle = asyncio.Event()
        self._idle.set()
        self.turns = TurnLedger()
        if engine.config.enable_prefix_caching:
            engine.set_placement(PrefixAffinity(self.turns))

    # ---- requests ----------------------------------------------------------------------

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str | None = None) -> RequestOutput | None:
        """One request (with ``params.n`` > 1 its samples ride on ``samples``); None when the gate rejects
        it (the caller reports it as aborted)."""
        outs = await self.generate_batch([prompt], [params], [request_id] if request_id else None)
        return outs[0] if outs is not None else None

    async def generate_batch(self, prompts: Sequence[Any], params: Sequence[SamplingParams],
                             request_ids: Sequence[str] | None = None,
                             plan: StagePlan | None = None) -> list[RequestOutput] | None:
        """Submit every prompt at once (they share a stage), then await them all.

        ``plan`` replaces the stage plan from the next stage on (this one, if the engine is idle).
        """
        if plan is not None:
            self.plan = plan
        async with self._admit:
            while True:
                while not self._open.is_set():
                    if self._rejecting:
                        return None
                    await self._open.wait()
                if not self._handles and not self._continues(prompts):  # idle: this batch opens a new stage
                    await asyncio.to_thread(begin_stage, self.engine, self.plan, self.stages)
                # No await from this check to the submits below: on the actor's one event loop,
                # abort_all either closes the gate before it (we wait again) or sees our requests.
                if self._open.is_set():
                    break
            families: list[list[RequestHandle]] = []  # the n samples of each prompt
            try:
                for i, (prompt, sp) in enumerate(zip(prompts, params)):
                    rid = request_ids[i] if request_ids else None
                    samples = self.engine.submit_samples(prompt, sp, rid)
                    for handle in samples:
                        self._handles[(handle.request_id, handle.sample_index)] = handle
                    families.append(samples)
            except BaseException:  # a bad request refuses the whole batch: withdraw what went in
                if families:
                    self.engine.abort([f[0].request_id for f in families])
                self._forget([h for f in families for h in f])
                raise
            self._idle.clear()
        try:
            outs = list(await asyncio.gather(*[await_samples(f) for f in families]))
        finally:
            self._forget([h for f in families for h in f])
        every = [s for o in outs for s in (o.samples or [o])]
        version = self.engine.weight_version
        for s in every:
            self.turns.record(s.prompt_token_ids, s.token_ids, version)
        failed = [s for s in every if s.finish_reason == "error"]
        if failed:  # as Engine.generate: a request lost to a worker failure is an error, not a result
            raise WorkerFailure(f"{len(failed)} of {len(every)} requests failed: {failed[0].error}",
                                partial_outputs=outs)
        return outs

    def _continues(self, prompts: Sequence[Any]) -> bool:
        """Whether every prompt continues an answer of this stage (token-id prompts only)."""
        version = self.engine.weight_version
        return all(isinstance(p, (list, tuple)) and self.turns.continues(p, version) for p in prompts)

    def _forget(self, handles: list[RequestHandle]) -> None:
        for h in handles:
            self._handles.pop((h.request_id, h.sample_index), None)
        if not self._handles:
            self._idle.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    # ---- gate and drain ---------------------------------------------------------------

    async def abort_all(self, reject: bool = False) -> list[str]:
        """Close the gate and abort every request in flight; returns their ids."""
        self._rejecting = reject
        self._open.clear()
        ids = list(dict.fromkeys(rid for rid, _ in self._handles))
        if ids:
            await asyncio.to_thread(self.engine.abort, ids)
        return ids

    def reopen(self) -> None:
        self._rejecting = False
        self._open.set()

    async def drain(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self._idle.wait(), timeout)

    async def exclusive(self, fn, *args: Any) -> Any:
        """Run ``fn(*args)`` (a tail-batched round, ``rounds.EngineRounds.step``) in a thread, alone: it
        starts once nothing is in flight, requests arriving meanwhile wait, and ``drain`` waits for it.
        ``abort_all`` does not cut it (its requests are not the frontend's; the round ends by itself)."""
        async with self._admit:
            await self._idle.wait()
            self._idle.clear()
            try:
                return await asyncio.to_thread(fn, *args)
            finally:
                self._idle.set()

    # ---- blocking engine calls, off the event loop ----------------------------------------

    async def call(self, fn, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        return await asyncio.to_thread(self.engine.update_weights, list(named_tensors))

    # ---- memory ----------------------------------------------------------------------------

    async def sleep(self, level: int = 1, tags: Iterable[str] | None = None) -> int:
        """Drain, then release the KV cache (level 1) or KV and weights (level 2), or exactly ``tags``;
        bytes freed (0 for what was released already)."""
        await self.drain()
        self.turns.reset()  # sleep drops the prefix cache: no turn after it has earlier turns' KV to keep
        return await asyncio.to_thread(self.engine.sleep, level, list(tags) if tags is not None else None)

    async def wake_up(self, tags: Iterable[str] | None = None) -> list[str]:
        """Restore what was released among ``tags``; what is not released is left alone."""
        return await asyncio.to_thread(self.engine.wake_up, list(tags) if tags is not None else None)


class LayoutViews:
    """Read-only layout queries shared by the actors that wrap an engine and its frontend."""

    engine: Engine
    frontend: AsyncEngineFrontend

    def layout(self) -> str:
        return str(self.engine.layout)

    def switches(self) -> list[dict]:
        return [asdict(e) for e in self.engine.switches]

    def stage_layouts(self) -> list[str]:
        """The layout each stage started in (always the base layout)."""
        return list(self.frontend.stages.layouts_at_start)
