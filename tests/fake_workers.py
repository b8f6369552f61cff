"""An in-process stand-in for ``WorkerPool``: the driver logic runs against it in milliseconds.

It speaks the real protocol (``StepCommand`` in, ``StepResult`` out; typed control
calls; ``SwitchPlan`` in, ``SwitchReport`` per rank out) and checks the
driver keeps its side of the contract: a prefill brings a block table, a decode
only appends blocks, every slot a step writes lies inside the rank's pool, and
no two sequences of a group hold the same block. The next token is a pure
function of (sequence, position), as real sampling is, so a switch, a
preemption or a restart never changes what a request generates. A verify step
(speculative decoding) samples every position of a row and keeps what
``pat_engine.speculative.verify.accept`` keeps, as the real leader does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pat_engine.errors import WorkerFailure
from pat_engine.parallel.layout import Layout
from pat_engine.protocol import StepCommand, StepResult, SwitchPlan, SwitchReport
from pat_engine.protocol.calls import ReleaseMemory, Reply, RestoreMemory, Switch, WorkerCall
from pat_engine.sampling.sampler import Sampled
from pat_engine.speculative.verify import accept


def fake_token(seq_id: int, position: int, vocab: int) -> int:
    """The token a fake worker samples at ``position`` of sequence ``seq_id``."""
    return (seq_id * 7919 + position * 104729) % vocab


@dataclass
class FakeWorkerPool:
    layout: Layout
    num_blocks: int
    block_size: int
    vocab: int = 1000
    hung_groups: set[int] = field(default_factory=set)  # groups whose steps never answer
    failing_seqs: set[int] = field(default_factory=set)  # a step holding one of these makes its leader raise
    fail_switch: bool = False  # the next switch call fails on rank 0
    steps: list[StepCommand] = field(default_factory=list)
    plans: list[SwitchPlan] = field(default_factory=list)
    calls: list[WorkerCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.world = self.layout.world
        self.pending: list[StepResult | Reply] = []
        self.tables: dict[int, dict[int, list[int]]] = {g: {} for g in range(self.layout.dp)}  # group -> seq -> table
        self.killed = False
        self.kv_released = False  # release_memory(kv=True) until restore_memory

    # ---- the WorkerPool surface the driver uses ------------------------------------------------

    def send(self, ranks: list[int], msg: StepCommand) -> None:
        assert isinstance(msg, StepCommand), f"only steps are sent without a reply, got {type(msg).__name__}"
        group = self.layout.group_of(ranks[0])
        assert ranks == self.layout.group_ranks(group), f"a step goes to a whole DP group, got ranks {ranks}"
        self.steps.append(msg)
        if group in self.hung_groups:
            return
        if any(s.seq_id in self.failing_seqs for s in msg.seqs):
            self.pending.append(Reply(-msg.step_id, ranks[0], False, error="Traceback:\nIndexError: poisoned step"))
            return
        self.pending.append(self._execute(group, msg))

    def ask(self, call: WorkerCall, ranks: list[int] | None = None):
        """Every addressed rank's answer, folded by the call's own reply rule (as ``WorkerPool.ask``)."""
        self.calls.append(call)
        ranks = list(range(self.world)) if ranks is None else ranks
        return call.reply.combine(self._answers(call, ranks))

    def _answers(self, call: WorkerCall, ranks: list[int]) -> list:
        if isinstance(call, Switch):
            return self._switch(call.plan)
        if isinstance(call, ReleaseMemory) and call.kv:
            self.kv_released = True
            self.tables = {g: {} for g in range(self.layout.dp)}
        if isinstance(call, RestoreMemory) and call.kv_blocks is not None:
            assert self.kv_released, "restore of a KV pool that holds live KV"
            self.kv_released, self.num_blocks = False, call.kv_blocks
        if isinstance(call, ReleaseMemory):
            return [0 for _ in ranks]
        return [None for _ in ranks]

    def poll(self, timeout: float | None, extra: list | None = None) -> list[StepResult | Reply]:
        out, self.pending = self.pending, []
        return out

    def alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed = True

    def shutdown(self, timeout: float = 10.0) -> None:
        self.killed = True

    # ---- what a group of ranks would do ---------------------------------------------------------

    def _execute(self, group: int, cmd: StepCommand) -> StepResult:
        assert not self.kv_released, "a step was dispatched while the KV cache is released"
        tables = self.tables[group]
        for sid, n in cmd.truncated:
            assert sid in tables and n <= len(tables[sid]), f"truncation of sequence {sid} to {n} blocks"
            del tables[sid][n:]
        for sid in cmd.released:
            tables.pop(sid, None)
        tokens = []
        for s in cmd.seqs:
            if cmd.is_prefill:
                assert s.block_table is not None and s.sampling is not None, "a prefill brings its table and sampling"
                tables[s.seq_id] = list(s.block_table)
            else:
                assert s.block_table is None and (len(s.token_ids) == 1 or cmd.verify), \
                    "a decode sends one token (more only in a verify step) and new blocks only"
                assert s.seq_id in tables, f"decode of sequence {s.seq_id} this group never prefilled"
                tables[s.seq_id].extend(s.new_blocks)
            table = tables[s.seq_id]
            end = s.start_pos + len(s.token_ids)
            assert len(table) * self.block_size >= end, f"sequence {s.seq_id}: {end} tokens do not fit its table"
            assert all(0 <= b < self.num_blocks for b in table), f"sequence {s.seq_id}: block outside the pool"
            if cmd.verify:  # every position of the row is sampled
                tokens += [fake_token(s.seq_id, s.start_pos + 1 + j, self.vocab) for j in range(len(s.token_ids))]
            else:
                tokens.append(fake_token(s.seq_id, end, self.vocab))
        self._check_writes(group, cmd)
        if cmd.verify:
            kept, counts = accept([s.token_ids[1:] for s in cmd.seqs], Sampled(tokens))
            return StepResult(cmd.step_id, group, kept.tokens, None, 0.001, counts=counts)
        return StepResult(cmd.step_id, group, tokens, None, 0.001)

    def _check_writes(self, group: int, cmd: StepCommand) -> None:
        """A step writes only blocks no other sequence holds: shared (prefix) blocks are read-only."""
        tables = self.tables[group]
        holders: dict[int, set[int]] = {}
        for sid, table in tables.items():
            for b in table:
                holders.setdefault(b, set()).add(sid)
        for s in cmd.seqs:
            table = tables[s.seq_id]
            for pos in range(s.start_pos, s.start_pos + len(s.token_ids)):
                block = table[pos // self.block_size]
                assert holders[block] == {s.seq_id}, \
                    f"group {group}: sequence {s.seq_id} writes block {block}, also held by {holders[block] - {s.seq_id}}"

    def _switch(self, plan: SwitchPlan) -> list[SwitchReport]:
        assert plan.old == self.layout, f"switch from {plan.old} but the workers are in {self.layout}"
        self.plans.append(plan)
        if self.fail_switch:
            self.fail_switch = False
            raise WorkerFailure("switch failed on rank 0: RuntimeError: injected", rank=0)
        self.layout, self.num_blocks = plan.new, plan.new_num_blocks
        self.tables = {g: {} for g in range(plan.new.dp)}
        for run in plan.runs:
            assert len(run.dst_table) * self.block_size >= run.num_tokens
            assert all(0 <= b < self.num_blocks for b in run.dst_table)
        for t in plan.tables:
            self.tables[t.group][t.seq_id] = list(t.block_table)
        return [SwitchReport.for_rank(r, group_cache_hit=False, groups_s=0.0, weights_s=0.001, kv_s=0.001,
                                      rebuild_s=0.0, total_s=0.002, weight_bytes_sent=0, weight_bytes_local=0,
                                      weight_bytes_allgather=0, kv_bytes_sent=0, peak_extra_bytes=0,
                                      kv_pool_bytes_before=0, kv_pool_bytes_after=0)
                for r in range(self.world)]
