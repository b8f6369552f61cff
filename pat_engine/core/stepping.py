"""``Stepping``: the requests and the steps of every DP group: admit, dispatch, results, status.

It owns one ``GroupScheduler`` per DP group and every unfinished request, so moving
requests between groups during a switch is a local data operation (``Switching``).
DP groups step independently: each idle group gets its next batch as soon as its
previous step returns. It also holds the worker pool every service talks through
(a restart replaces it) and the speculation hooks of a decode step.

Departure from the architecture picture (docs/switch.md), on purpose: batches are
picked here (per group) rather than by each group's leader, and sent to every rank of
the group directly. With all request state in one place the switch needs no gathering
of queues from leaders, and no per-step TP broadcast is needed.

With ``async_scheduling`` a group may have a second decode step in flight (``ahead``): sent right
behind the one in flight, its tokens that step's draw (``GroupScheduler.schedule_following``). When the
first is answered the second takes its place, and the next dispatch sends the one after it, or, when
none may go, tells the ranks to answer the step they hold (``AnswerHeld``; on a GPU a rank holds a step's
answer until the next step is launched, so the device never waits for the driver between the two).

Runs in the loop thread: methods marked ``on_loop`` may be called from any thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pat_engine.config import EngineConfig
from pat_engine.core.loop_thread import LoopThread, on_loop
from pat_engine.core.memory import MemoryPlan
from pat_engine.core.request import Sequence
from pat_engine.core.scheduler import GroupScheduler
from pat_engine.core.step_records import InFlight, StepRecord, StepWatcher
from pat_engine.core.timeline import Timeline
from pat_engine.core.worker_pool import WorkerPool
from pat_engine.errors import WorkerFailure, last_traceback_line
from pat_engine.parallel.dp_placement import PlacementRule
from pat_engine.parallel.layout import Layout
from pat_engine.parallel.p2p import check_path
from pat_engine.predictor.policy import ClusterStatus, GroupSnapshot, RequestSnapshot
from pat_engine.protocol import AnswerHeld, StepCommand, StepResult
from pat_engine.protocol.calls import BandwidthProbe, Reply, StartProfile, Stats, StopProfile
from pat_engine.speculative.manager import Speculation

PAUSE_MODES = ("in_place", "retract", "abort")


def fewest_outstanding(seq: Sequence, schedulers: list[GroupScheduler]) -> int:
    """The default admission placement: the DP group with the fewest outstanding tokens (lowest on ties)."""
    return min(range(len(schedulers)), key=lambda g: (schedulers[g].outstanding_tokens(), g))


class Stepping:
    def __init__(self, config: EngineConfig, memory_plan: MemoryPlan, pool: WorkerPool, layout: Layout,
                 thread: LoopThread, timeline: Timeline):
        self.config, self.memory_plan, self.pool, self.thread = config, memory_plan, pool, thread
        self.timeline = timeline  # step records are stamped with its clock
        self.watcher: StepWatcher | None = None  # the switching, once the coordinator has built it
        # optional admission rule: placement(seq, schedulers) -> group (Engine.set_placement)
        self.placement: PlacementRule | None = None
        self.paused = False
        self.stage_decode_steps = 0  # set before the first install_layout, which copies it into the groups
        self.generated_tokens = 0  # over the engine's life (the timeline's tokens/s)
        self.inflight: dict[int, InFlight] = {}
        self.ahead: dict[int, InFlight] = {}  # async scheduling: the step sent behind a group's step in flight
        self.async_scheduling = config.async_scheduling_on()  # set_async_scheduling flips it on a live engine
        # ranks hold each following step's answer until their next message (a GPU never waits for the driver;
        # a CPU rank answers at once, its draw is on the host already)
        self.hold_answers = config.host_free_during_steps
        self._held: set[int] = set()  # groups whose step in flight is held on its ranks, not released yet
        self.install_layout(layout, self.new_schedulers(layout))
        self.seqs: dict[int, Sequence] = {}  # unfinished, by seq id
        self.step_log: list[StepRecord] | None = None  # set to a list to record every step
        # speculative decoding (docs/speculative.md): drafts for small decode batches; None when off
        self.speculation = Speculation(config.speculative) if config.speculative.enabled else None
        self.last_step_at: float | None = None  # monotonic time of the last step result (for /health)

    # ---- layout ----------------------------------------------------------------------

    def new_schedulers(self, layout: Layout) -> list[GroupScheduler]:
        """One empty scheduler per DP group of ``layout``, each with the layout's block count."""
        cfg = self.config
        blocks = self.memory_plan.num_blocks(layout)
        return [GroupScheduler(g, blocks, cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                               cfg.enable_prefix_caching)
                for g in range(layout.dp)]

    def install_layout(self, layout: Layout, schedulers: list[GroupScheduler]) -> None:
        """Adopt ``layout`` with its groups' schedulers (after a switch, a restart, or at start)."""
        if self.inflight:
            raise RuntimeError("install_layout with steps in flight: drain() first")
        self.layout = layout
        self.schedulers = schedulers
        # the stage's decode-step count goes on across a switch or restart: the policy and the timeline
        # are consulted only when it grows, so new groups starting at 0 would silence both for a while
        for sched in self.schedulers:
            sched.decode_steps = self.stage_decode_steps
        self.inflight, self.ahead, self._held = {}, {}, set()
        self._decode_ema: dict[int, float] = {}
        self._answered_at: dict[int, float] = {}  # each group's last answer (a following step's start)

    def restart(self, pool: WorkerPool, layout: Layout) -> list[Sequence]:
        """Adopt a fresh worker world: every unfinished request is queued again for recompute."""
        self.pool = pool
        seqs = sorted(self.seqs.values(), key=lambda s: s.seq_id)
        self.inflight, self.ahead = {}, {}  # the old world's steps will never answer
        self.install_layout(layout, self.new_schedulers(layout))
        families: dict[int, list[Sequence]] = {}  # the samples of one prompt stay together
        for seq in seqs:
            seq.forget_kv()
            self.seqs.pop(seq.seq_id)
            families.setdefault((seq.first_sample or seq).seq_id, []).append(seq)
        for family in families.values():
            self.add_samples(family)
        return seqs

    def start_stage(self) -> None:
        """A new generation stage counts its decode steps from 0."""
        self.stage_decode_steps = 0
        for s in self.schedulers:
            s.decode_steps = 0

    # ---- requests ----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.add_samples([seq])

    def add_samples(self, seqs: list[Sequence]) -> None:
        """Queue the samples of one prompt on one DP group, so they can share the prompt's KV blocks:
        the group the admission placement picks for the first (``placement``), else the one with the
        fewest outstanding tokens."""
        rule = self.placement or fewest_outstanding
        group = rule(seqs[0], self.schedulers)
        for seq in seqs:
            self.schedulers[group].add(seq)
            self.seqs[seq.seq_id] = seq
        if self.speculation is not None:
            self.speculation.track(seqs)

    def _take(self, seq_ids: list[int]) -> list[Sequence]:
        """The unfinished sequences among ``seq_ids``, out of the engine and their queues (KV freed)."""
        out = []
        for sid in seq_ids:
            seq = self.seqs.pop(sid, None)
            if seq is not None:
                self.schedulers[seq.group].remove(seq)
                self._left(seq)
                out.append(seq)
        return out

    def _left(self, seq: Sequence) -> None:
        """``seq`` left the engine's queues (finished, aborted or withdrawn)."""
        if self.speculation is not None:
            self.speculation.release(seq)

    def abort(self, seq_ids: list[int], reason: str = "abort", error: str | None = None) -> list[Sequence]:
        out = self._take(seq_ids)
        for seq in out:
            seq.finish(reason, error)
            _notify(seq, 0)
        return out

    def finish_unfinished(self, reason: str, error: str) -> int:
        """End every request not finished yet with ``reason`` (their tokens kept); how many."""
        return len(self.abort([s.seq_id for s in self.unfinished()], reason, error))

    @on_loop
    def abort_all(self, message: str) -> int:
        return self.finish_unfinished("abort", message)

    def withdraw(self, seq_ids: list[int]) -> list[Sequence]:
        """Take requests out of the queues without finishing them (held back after a crash); KV dropped."""
        return self._take(seq_ids)

    def take_unfinished(self) -> list[Sequence]:
        """Every unfinished sequence out of its scheduler, by arrival (a switch re-places them);
        their KV stays where it is until the switch has moved or dropped it."""
        if self.inflight:
            raise RuntimeError("take_unfinished with steps in flight: drain() first")
        return sorted((s for sched in self.schedulers for s in sched.take_all()), key=lambda s: s.seq_id)

    def retract_all(self) -> int:
        """Every running sequence frees its KV and waits to be prefilled again; drain() first."""
        if self.inflight:
            raise RuntimeError("retract_all with steps in flight: drain() first")
        return sum(sched.retract_running() for sched in self.schedulers)

    def step_members(self, rank: int | None) -> list[Sequence]:
        """Unfinished requests in the steps in flight on ``rank``'s DP group (every group's when None)."""
        groups = [g for g in self.inflight if rank is None or rank in self.layout.group_ranks(g)]
        flights = [f for g in groups for f in (self.inflight[g], self.ahead.get(g)) if f is not None]
        return list({s.seq_id: s for f in flights for s in f.batch if s.seq_id in self.seqs}.values())

    def has_work(self) -> bool:
        return bool(self.inflight) or any(s.has_work() for s in self.schedulers)

    def unfinished(self) -> list[Sequence]:
        return list(self.seqs.values())

    @on_loop
    def num_unfinished(self) -> int:
        return len(self.seqs)

    @on_loop
    def set_placement(self, placement: PlacementRule | None) -> None:
        self.placement = placement

    # ---- pausing ---------------------------------------------------------------------------

    @on_loop
    def pause(self, mode: str) -> int:
        """Start no step until ``resume``; returns how many requests ``mode`` touched (Engine.pause)."""
        self.paused = True
        self.drain()
        if mode == "retract":
            return self.retract_all()
        if mode == "abort":
            return self.finish_unfinished("abort", "aborted by pause (mode abort)")
        return len(self.unfinished())

    @on_loop
    def resume(self) -> None:
        self.paused = False

    # ---- steps -------------------------------------------------------------------------------

    def tick(self, timeout: float | None, wake=None, dispatch: bool = True,
             after_dispatch: Callable[[], None] | None = None) -> None:
        """Dispatch idle groups (when ``dispatch``), call ``after_dispatch`` (host work that may overlap the
        steps just sent), then handle whatever results arrive within ``timeout``."""
        if dispatch:
            self._dispatch()
        self._release_held()
        if after_dispatch is not None:
            after_dispatch()
        for msg in self.pool.poll(timeout, [wake] if wake is not None else None):
            self._handle(msg)
        self._check_step_timeouts()

    def drain(self) -> None:
        """Wait for every in-flight step and apply its results: the step boundary a switch, a pause,
        a weight update or a memory release needs."""
        while self.inflight:
            self._release_held()
            for msg in self.pool.poll(1.0):
                self._handle(msg)
            self._check_step_timeouts()

    def _check_step_timeouts(self) -> None:
        """A step that never returns (a hung rank that did not die) becomes an error, not a hang."""
        limit = self.config.step_timeout_s
        now = time.monotonic()
        for g, flight in self.inflight.items():
            if now - flight.sent_at > limit:
                raise WorkerFailure(f"DP group {g} (ranks {self.layout.group_ranks(g)}) did not finish a step "
                                    f"within step_timeout_s={limit:.0f}s", rank=self.layout.leader(g))

    def _dispatch(self) -> None:
        for g, sched in enumerate(self.schedulers):
            flight = self.inflight.get(g)
            if flight is not None:  # async scheduling: the step after it, if it may go now
                if g not in self.ahead and (follower := self._following(g, flight)) is not None:
                    self._send_ahead(g, *follower)
                continue
            drafts = self._draft_fn()
            item = sched.schedule(drafts)
            if item is None:
                continue
            cmd, batch = item
            flight = InFlight(cmd, batch, time.monotonic(), len(self.inflight) + 1,
                              drafts is not None and not cmd.is_prefill)
            follower = self._following(g, flight)
            cmd.hold = follower is not None and self.hold_answers  # released by the follower, sent next
            self.pool.send(self.layout.group_ranks(g), cmd)
            self.inflight[g] = flight
            if follower is not None:
                self._send_ahead(g, *follower)

    def _following(self, g: int, flight: InFlight) -> tuple[StepCommand, list[Sequence]] | None:
        """The step to send behind ``flight`` (async scheduling), or None where it may not go: a prefill,
        a verify step, speculation on, or a row that may not run ahead (``Sequence.runs_ahead``)."""
        cmd = flight.cmd
        if (not self.async_scheduling or cmd.is_prefill or cmd.verify or self.speculation is not None
                or not all(s.runs_ahead for s in flight.batch)):
            return None
        return self.schedulers[g].schedule_following(cmd, flight.batch, hold=self.hold_answers)

    def _send_ahead(self, g: int, cmd: StepCommand, batch: list[Sequence]) -> None:
        """Send a following step; the rank holding the answer of the step it follows launches it, then answers."""
        self.pool.send(self.layout.group_ranks(g), cmd)
        self.ahead[g] = InFlight(cmd, batch, time.monotonic(), len(self.inflight))
        self._held.discard(g)

    def _release_held(self) -> None:
        """Groups whose held step no following step will release: their ranks answer it now."""
        for g in self._held:
            self.pool.send(self.layout.group_ranks(g), AnswerHeld(self.inflight[g].cmd.step_id))
        self._held.clear()

    def _handle(self, msg: StepResult | Reply) -> None:
        if isinstance(msg, Reply):
            if not msg.ok:
                raise WorkerFailure(f"rank {msg.rank} failed during a step: {last_traceback_line(msg.error)}\n{msg.error}",
                                    rank=msg.rank)
            return
        flight = self.inflight.get(msg.group)
        if flight is None or flight.cmd.step_id != msg.step_id:
            return  # a stale answer from before a restart
        self._promote_ahead(msg.group)
        now = self.last_step_at = time.monotonic()
        sched = self.schedulers[msg.group]
        is_prefill = flight.cmd.is_prefill
        # a following step starts on its ranks when the step before it ends (one answer earlier)
        started = max(flight.sent_at, self._answered_at.get(msg.group, 0.0)) if flight.cmd.follows is not None \
            else flight.sent_at
        elapsed, self._answered_at[msg.group] = now - started, now
        new_tokens = sum(len(s.token_ids) for s in flight.cmd.seqs)
        context_tokens = sum(s.start_pos + len(s.token_ids) for s in flight.cmd.seqs)
        if is_prefill:  # a prefill's time never enters the decode average, watcher or not
            if self.watcher is not None:
                self.watcher.prefill_done(self.layout.tp, new_tokens, msg.forward_seconds)
        else:
            prev = self._decode_ema.get(msg.group)
            self._decode_ema[msg.group] = elapsed if prev is None else 0.8 * prev + 0.2 * elapsed
            if self.watcher is not None and not flight.speculative:
                self.watcher.decode_step_done(self.layout.tp, len(flight.batch), context_tokens, elapsed)
        if self.step_log is not None:
            self.step_log.append(StepRecord(
                self.timeline.now(), self.layout.tp, self.layout.dp, msg.group, is_prefill, len(flight.batch),
                context_tokens, new_tokens, elapsed, msg.forward_seconds, flight.busy_groups, msg.head_seconds,
                msg.sample_seconds))
        applied = [not s.finished for s in flight.batch]  # a row of a request that ended meanwhile is dropped
        finished = sched.on_result(flight.batch, is_prefill, msg)
        counts = msg.counts or [1] * len(flight.batch)  # tokens each request gained (more after a verify step)
        if self.speculation is not None and not is_prefill:
            self.speculation.observe_decode(self.layout.tp, flight.batch, flight.cmd.seqs, counts,
                                            elapsed, flight.speculative, flight.cmd.verify)
        for seq, n in zip(flight.batch, counts):
            if seq.seq_id in self.seqs:
                _notify(seq, n)
        for seq in finished:
            self.seqs.pop(seq.seq_id, None)
            self._left(seq)
        self.generated_tokens += sum(n for n, kept in zip(counts, applied) if kept)
        steps = max(s.decode_steps for s in self.schedulers)
        if not is_prefill and steps > self.stage_decode_steps:
            self.stage_decode_steps = steps
            if self.watcher is not None:
                self.watcher.decode_steps_grew(steps)

    def _promote_ahead(self, g: int) -> None:
        """Group ``g``'s step in flight was answered: the step sent behind it (if any) takes its place."""
        self.inflight.pop(g)
        ahead = self.ahead.pop(g, None)
        if ahead is not None:
            self.inflight[g] = ahead
            if ahead.cmd.hold:
                self._held.add(g)  # the next dispatch sends its follower, else _release_held

    @on_loop
    def set_async_scheduling(self, on: bool, hold_answers: bool | None = None) -> None:
        """Async scheduling on or off from the next dispatch (A/B runs in one engine); ``hold_answers``
        (None: unchanged) makes ranks hold a step's answer until their next message, as a GPU rank does."""
        self.async_scheduling = on
        if hold_answers is not None:
            self.hold_answers = hold_answers

    @on_loop
    def set_step_log(self, step_log: list[StepRecord] | None) -> None:
        """Append a ``StepRecord`` per step to ``step_log`` (None: stop recording)."""
        self.step_log = step_log

    @on_loop
    def status(self) -> ClusterStatus:
        groups = []
        for g, sched in enumerate(self.schedulers):
            reqs = tuple(RequestSnapshot.of(s) for s in sched.unfinished())
            groups.append(GroupSnapshot(g, reqs, sched.blocks.num_free, sched.blocks.num_blocks, self._decode_ema.get(g)))
        return ClusterStatus(time.time(), self.layout, tuple(groups), self.stage_decode_steps, self.config.block_size,
                             self.placement, self.speculation.status() if self.speculation is not None else None)

    # ---- speculation hooks (docs/speculative.md) -----------------------------------------------

    def _draft_fn(self):
        """The speculation's draft proposer while it is on for this many unfinished requests, else None."""
        spec = self.speculation
        return spec.drafts if spec is not None and spec.active(len(self.seqs)) else None

    @on_loop
    def speculation_stats(self) -> dict | None:
        """Speculative decoding totals (None: off): verify steps, drafted and accepted tokens."""
        return None if self.speculation is None else self.speculation.stats.to_dict()

    @on_loop
    def set_draft_proposer(self, proposer) -> None:
        """Draft with ``proposer`` (a ``pat_engine.speculative.DraftProposer``); speculation must be on."""
        if self.speculation is None:
            raise RuntimeError("speculative decoding is off (EngineConfig.speculative)")
        self.speculation.use(proposer, self.unfinished())

    @on_loop
    def remember_responses(self, prompt: list[int], responses: list[list[int]]) -> None:
        """Earlier responses to ``prompt`` as draft sources (kept with ``speculative.history`` on)."""
        if self.speculation is not None:
            for response in responses:
                self.speculation.remember(prompt, response)

    # ---- KV blocks and workers, for diagnostics ----------------------------------------------

    @on_loop
    def prefix_cache_stats(self) -> dict:
        """Prefix-cache hit rate (prompt tokens found cached at admission) and unreferenced cached blocks."""
        queried = sum(s.blocks.stats.queried_tokens for s in self.schedulers)
        hit = sum(s.blocks.stats.hit_tokens for s in self.schedulers)
        return {"queried_tokens": queried, "hit_tokens": hit, "hit_rate": hit / queried if queried else 0.0,
                "cached_blocks": sum(s.blocks.num_cached for s in self.schedulers),
                "used_blocks": sum(s.blocks.num_blocks - s.blocks.num_free for s in self.schedulers)}

    @on_loop
    def flush_prefix_cache(self) -> None:
        """Forget every cached prefix block (after a weight change their KV is stale)."""
        for sched in self.schedulers:
            sched.blocks.flush_cache()

    def check_block_invariants(self) -> None:
        """``AssertionError`` unless every group's blocks are free or owned by exactly one sequence."""
        for sched in self.schedulers:
            sched.check_blocks()

    @on_loop
    def kv_blocks(self) -> dict:
        """Free, cached and total KV blocks per DP group and whether the block invariants hold
        (reported, not raised)."""
        groups = [{"group": g, "free": s.blocks.num_free, "cached": s.blocks.num_cached,
                   "total": s.blocks.num_blocks} for g, s in enumerate(self.schedulers)]
        out = {"layout": str(self.layout), "groups": groups, "unfinished": len(self.seqs)}
        try:
            self.check_block_invariants()
            out["invariants"] = "ok"
        except AssertionError as exc:
            out["invariants"] = f"violated: {exc}"
        return out

    @on_loop
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.pool.procs]

    @on_loop
    def worker_stats(self, release_cached: bool = False) -> list[dict]:
        return self.pool.ask(Stats(release_cached))

    @on_loop
    def ask_profilers(self, call: StartProfile | StopProfile) -> list | None:
        """Start or stop every rank's profile (core/profiling.py)."""
        return self.pool.ask(call)

    @on_loop
    def bandwidth_probe(self, nbytes: int, repeats: int, path: str | None = None) -> list[float]:
        """Each rank's best seconds to exchange ``nbytes`` with its neighbours, all ranks at once, along
        ``path`` (parallel/p2p.py; None: the world's)."""
        if path is not None:
            check_path(path, self.pool.placement.host_staged)
        return self.pool.ask(BandwidthProbe(nbytes, repeats, path))


def _notify(seq: Sequence, new_tokens: int) -> None:
    if seq.on_update is not None:
        seq.on_update(seq, new_tokens)
