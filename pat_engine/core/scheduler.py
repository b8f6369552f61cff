"""Continuous batching for one DP group.

Each step is either a prefill of newly admitted sequences (admission limited
by free KV blocks, sequence count and the token budget) or one decode step of
every running sequence. When a decode step needs a block and none is free,
the most recently admitted sequence is preempted: its blocks are freed and it
is prefilled again later from its tokens (recompute), which yields the same
tokens because sampling depends only on (seed, position).
"""

from __future__ import annotations

from collections import deque

from pat_engine.core.block_allocator import BlockAllocator, blocks_needed
from pat_engine.core.request import Sequence, SeqStatus
from pat_engine.protocol import SeqStep, StepCommand


class GroupScheduler:
    def __init__(self, group: int, num_blocks: int, block_size: int, max_num_seqs: int, max_batched_tokens: int):
        self.group = group
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._released: list[int] = []
        self._step_id = 0
        self.decode_steps = 0

    # ---- queue management -------------------------------------------------------------

    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.group = self.group
        seq.status = SeqStatus.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def add_running(self, seq: Sequence, block_table: list[int]) -> None:
        """Adopt a sequence whose KV already sits in this group's pool (after a KV migration).

        ``block_table`` must come from this group's allocator; the workers already know it.
        """
        seq.group = self.group
        seq.status = SeqStatus.RUNNING
        seq.block_table = block_table
        seq.blocks_sent = len(block_table)
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def unfinished(self) -> list[Sequence]:
        return self.running + list(self.waiting)

    def outstanding_tokens(self) -> int:
        return sum(s.outstanding_tokens() for s in self.unfinished())

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._drop_kv(seq)

    def _drop_kv(self, seq: Sequence) -> None:
        if seq.block_table:
            self.allocator.free(seq.block_table)
            self._released.append(seq.seq_id)
        seq.forget_kv()

    def check_blocks(self) -> None:
        """Raise ``AssertionError`` unless free + owned == total and no block is owned twice or also free."""
        owned = [b for s in self.unfinished() for b in s.block_table]
        free = self.allocator.free_blocks()
        problems = []
        if len(set(owned)) != len(owned):
            problems.append("a block is owned by two sequences")
        if len(set(free)) != len(free):
            problems.append("a block is free twice")
        if set(owned) & set(free):
            problems.append(f"blocks both owned and free: {sorted(set(owned) & set(free))[:8]}")
        if len(set(owned) | set(free)) != self.allocator.num_blocks or len(owned) + len(free) != self.allocator.num_blocks:
            problems.append(f"{len(owned)} owned + {len(free)} free != {self.allocator.num_blocks} blocks")
        if problems:
            raise AssertionError(f"DP group {self.group} KV blocks: " + "; ".join(problems))

    def take_all(self) -> list[Sequence]:
        """Hand every unfinished sequence back (for a switch); their KV stays put until then."""
        seqs = self.running + list(self.waiting)
        self.running, self.waiting = [], deque()
        return seqs

    # ---- scheduling ---------------------------------------------------------------------

    def schedule(self) -> tuple[StepCommand, list[Sequence]] | None:
        batch = self._schedule_prefill()
        if batch:
            return self._command(True, batch), batch
        batch = self._schedule_decode()
        if batch:
            self.decode_steps += 1
            return self._command(False, batch), batch
        return None

    def _schedule_prefill(self) -> list[Sequence]:
        batch: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            need = blocks_needed(seq.length, self.block_size)
            if batch and tokens + seq.length > self.max_batched_tokens:
                break
            if not self.allocator.can_allocate(need):
                break
            self.waiting.popleft()
            seq.block_table = self.allocator.allocate(need)
            seq.blocks_sent = 0
            batch.append(seq)
            tokens += seq.length
        return batch

    def _schedule_decode(self) -> list[Sequence]:
        batch: list[Sequence] = []
        running = list(self.running)
        while running:
            seq = running.pop(0)
            # the last token (position length-1) is written this step
            while blocks_needed(seq.length, self.block_size) > len(seq.block_table):
                if self.allocator.can_allocate(1):
                    seq.block_table += self.allocator.allocate(1)
                elif running:
                    self._preempt(running.pop())  # latest admitted gives way
                else:
                    self._preempt(seq)
                    break
            else:
                batch.append(seq)
        return batch

    def retract_running(self) -> int:
        """Free the KV of every running sequence and queue it again at the front, in its order
        (preemption by recompute, for all of them: a pause in SGLang's "retract" mode)."""
        seqs = list(self.running)
        for seq in reversed(seqs):
            self._preempt(seq)
        return len(seqs)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._drop_kv(seq)
        seq.preemptions += 1
        self.add(seq, front=True)

    def _command(self, is_prefill: bool, batch: list[Sequence]) -> StepCommand:
        steps = []
        for seq in batch:
            if is_prefill:
                steps.append(SeqStep(seq.seq_id, seq.tokens, 0, block_table=list(seq.block_table), sampling=seq.spec,
                                     suppressed=seq.suppressed_now()))
            else:
                steps.append(SeqStep(seq.seq_id, [seq.tokens[-1]], seq.length - 1,
                                     new_blocks=seq.block_table[seq.blocks_sent:], suppressed=seq.suppressed_now()))
            seq.blocks_sent = len(seq.block_table)
        self._step_id += 1
        released, self._released = self._released, []
        return StepCommand(self._step_id, is_prefill, steps, released)

    def on_result(self, batch: list[Sequence], is_prefill: bool, tokens: list[int], logprobs: list[float] | None) -> list[Sequence]:
        """Apply one step's sampled tokens; returns the sequences that finished."""
        finished = []
        for i, seq in enumerate(batch):
            if seq.finished:  # aborted while the step ran
                continue
            seq.num_cached = seq.length
            if is_prefill:
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
            seq.append_token(tokens[i], logprobs[i] if logprobs else None)
            if seq.finished:
                self.remove(seq)
                finished.append(seq)
        return finished
