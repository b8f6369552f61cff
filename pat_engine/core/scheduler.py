"""Continuous batching for one DP group.

Each step is either a prefill of newly admitted sequences (admission limited
by free KV blocks, sequence count and the token budget) or one decode step of
every running sequence. At admission a sequence reuses the cached full blocks
of its longest cached prefix and prefills only the rest. When a decode step
needs a block and none is free, the most recently admitted sequence is
preempted: its blocks are released and it is prefilled again later from its
tokens (recompute), which yields the same tokens because sampling depends only
on (seed, position). The n samples of one prompt wait for the first sample's
prefill, then share its full prompt blocks.

Speculative decoding (docs/speculative.md): a decode step may carry drafts for some of
its sequences (a verify step). Their draft tokens' blocks are taken only from free
blocks (nobody is preempted for a guess); after the result, blocks beyond the accepted
tokens go back to the pool and the workers cut their tables to match
(``StepCommand.truncated``), so a sequence's table always covers its length and no more.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Hashable

from pat_engine.core.block_pool import BlockPool, blocks_needed
from pat_engine.core.request import Sequence, SeqStatus
from pat_engine.protocol import SeqStep, StepCommand, StepResult

DraftFn = Callable[[list[Sequence]], dict[int, list[int]]]  # a decode batch -> seq_id -> drafted tokens


class GroupScheduler:
    def __init__(self, group: int, num_blocks: int, block_size: int, max_num_seqs: int, max_batched_tokens: int,
                 enable_prefix_caching: bool = True):
        self.group = group
        self.block_size = block_size
        self.blocks = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._released: list[int] = []
        self._truncated: list[tuple[int, int]] = []  # (seq_id, blocks kept) since the last command
        self._step_id = 0
        self.decode_steps = 0

    # ---- queue management -------------------------------------------------------------

    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.group = self.group
        seq.status = SeqStatus.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def add_running(self, seq: Sequence, block_table: list[int], blocks_registered: int = 0) -> None:
        """Adopt a sequence whose KV already sits in this group's pool (after a KV migration).

        ``block_table`` must hold references taken from this group's pool; the workers already know it.
        ``blocks_registered``: its leading blocks already indexed in this group's prefix cache.
        """
        seq.group = self.group
        seq.status = SeqStatus.RUNNING
        seq.block_table = block_table
        seq.blocks_sent = len(block_table)
        seq.blocks_registered = blocks_registered
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def unfinished(self) -> list[Sequence]:
        return self.running + list(self.waiting)

    def outstanding_tokens(self) -> int:
        return sum(s.outstanding_tokens() for s in self.unfinished())

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._drop_kv(seq)

    def _drop_kv(self, seq: Sequence) -> None:
        if seq.block_table:
            self.blocks.free(seq.block_table)
            self._released.append(seq.seq_id)
        seq.forget_kv()

    def check_blocks(self) -> None:
        """Raise ``AssertionError`` unless every block is free, cached, or referenced exactly as often
        as the sequence tables of this group hold it."""
        problems = self.blocks.check([b for s in self.unfinished() for b in s.block_table])
        if problems:
            raise AssertionError(f"DP group {self.group} KV blocks: " + "; ".join(problems))

    def take_all(self) -> list[Sequence]:
        """Hand every unfinished sequence back (for a switch); their KV stays put until then."""
        seqs = self.running + list(self.waiting)
        self.running, self.waiting = [], deque()
        return seqs

    # ---- scheduling ---------------------------------------------------------------------

    def schedule(self, drafts: DraftFn | None = None) -> tuple[StepCommand, list[Sequence]] | None:
        """The next step; ``drafts`` (speculative decoding) proposes tokens for a decode batch."""
        batch = self._schedule_prefill()
        if batch:
            return self._command(True, batch), batch
        batch = self._schedule_decode()
        if batch:
            self.decode_steps += 1
            proposed = self._reserve_drafts(batch, drafts(batch)) if drafts is not None else {}
            return self._command(False, batch, proposed), batch
        return None

    def _schedule_prefill(self) -> list[Sequence]:
        batch: list[Sequence] = []
        tokens = 0
        held: list[Sequence] = []  # samples waiting for their first sibling's prefill keep their place
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.waits_for_sibling():
                held.append(self.waiting.popleft())
                continue
            hits = self._cached_prefix(seq)
            cached = len(hits) * self.block_size
            need = blocks_needed(seq.length, self.block_size) - len(hits)
            if (batch and tokens + seq.length - cached > self.max_batched_tokens) or not self.blocks.can_allocate(need):
                self.blocks.free(hits)
                break
            self.waiting.popleft()
            seq.block_table = hits + self.blocks.allocate(need)
            seq.blocks_sent = 0
            seq.num_cached = cached
            seq.blocks_registered = len(hits)
            if seq.preemptions == 0 and not seq.output_ids:  # its first admission
                seq.cached_tokens = cached
            batch.append(seq)
            tokens += seq.length - cached
        self.waiting.extendleft(reversed(held))
        return batch

    def _schedule_decode(self) -> list[Sequence]:
        batch: list[Sequence] = []
        running = list(self.running)
        while running:
            seq = running.pop(0)
            # the last token (position length-1) is written this step
            while blocks_needed(seq.length, self.block_size) > len(seq.block_table):
                if self.blocks.can_allocate(1):
                    seq.block_table += self.blocks.allocate(1)
                elif running:
                    self._preempt(running.pop())  # latest admitted gives way
                else:
                    self._preempt(seq)
                    break
            else:
                batch.append(seq)
        return batch

    def _reserve_drafts(self, batch: list[Sequence], drafts: dict[int, list[int]]) -> dict[int, list[int]]:
        """Blocks for the draft tokens' KV (positions length .. length + k - 1), from free blocks only;
        a draft that does not fit is shortened to what the sequence's blocks already hold. The step's
        tokens stay within ``max_batched_tokens``."""
        out = {}
        budget = self.max_batched_tokens - len(batch)
        for seq in batch:
            draft = drafts.get(seq.seq_id, [])[: max(budget, 0)]
            if not draft:
                continue
            need = blocks_needed(seq.length + len(draft), self.block_size) - len(seq.block_table)
            if need > 0 and self.blocks.can_allocate(need):
                seq.block_table += self.blocks.allocate(need)
            draft = draft[: len(seq.block_table) * self.block_size - seq.length]
            if draft:
                out[seq.seq_id] = draft
                budget -= len(draft)
        return out

    def _trim_table(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's length (held for drafts that were rejected)."""
        keep = blocks_needed(seq.length, self.block_size)
        if len(seq.block_table) > keep:
            self.blocks.free(seq.block_table[keep:])
            del seq.block_table[keep:]
            seq.blocks_sent = min(seq.blocks_sent, keep)
            self._truncated.append((seq.seq_id, keep))

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

    def _command(self, is_prefill: bool, batch: list[Sequence], drafts: dict[int, list[int]] | None = None) -> StepCommand:
        drafts = drafts or {}
        steps = []
        for seq in batch:
            if is_prefill:
                tokens = seq.tokens
                steps.append(SeqStep(seq.seq_id, tokens[seq.num_cached:], seq.num_cached,
                                     block_table=list(seq.block_table), sampling=seq.sampling,
                                     suppressed=seq.suppressed_now(),
                                     context=tokens[:seq.num_cached] if seq.sampling.has_penalties else None,
                                     prompt_logprobs=seq.params.prompt_logprobs if seq.wants_prompt_logprobs() else None))
            else:
                steps.append(SeqStep(seq.seq_id, [seq.last_token] + drafts.get(seq.seq_id, []), seq.length - 1,
                                     new_blocks=seq.block_table[seq.blocks_sent:], suppressed=seq.suppressed_now()))
            seq.blocks_sent = len(seq.block_table)
        self._step_id += 1
        released, self._released = self._released, []
        truncated, self._truncated = self._truncated, []
        return StepCommand(self._step_id, is_prefill, steps, released, verify=bool(drafts), truncated=truncated)

    def on_result(self, batch: list[Sequence], is_prefill: bool, result: StepResult) -> list[Sequence]:
        """Apply one step's sampled tokens; returns the sequences that finished.

        A verify result brings ``counts[i]`` tokens for sequence ``i``: each one's KV was written by
        the step with the draft token that equals it, except the last's (run next step), so they are
        appended one by one exactly as decode steps would have, and the table is trimmed after."""
        finished = []
        row = 0
        for i, seq in enumerate(batch):
            n = result.counts[i] if result.counts is not None else 1
            rows, row = range(row, row + n), row + n
            if seq.finished:  # aborted while the step ran
                continue
            if is_prefill:
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                if result.prompt_logprobs and seq.seq_id in result.prompt_logprobs and seq.prompt_logprobs is None:
                    seq.prompt_logprobs = result.prompt_logprobs[seq.seq_id]
            for r in rows:
                seq.num_cached = seq.length
                seq.append_token(result.tokens[r], result.logprobs[r] if result.logprobs else None,
                                 result.top_logprobs[r] if result.top_logprobs else None)
                if seq.finished:
                    break
            self._register_full_blocks(seq)
            if seq.finished:
                self.remove(seq)
                finished.append(seq)
            elif result.counts is not None:
                self._trim_table(seq)
        return finished

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Referenced blocks holding the longest cached prefix of ``seq`` (none when it cannot share)."""
        can_share, namespace = self._prefix_namespace(seq)
        # the last token always runs again: its logits are what the next token is sampled from
        return self.blocks.match_prefix(seq.tokens, namespace, seq.length - 1) if can_share else []

    def cached_tokens(self, seq: Sequence) -> int:
        """Leading tokens of ``seq`` an admission to this group would find cached now (read-only)."""
        can_share, namespace = self._prefix_namespace(seq)
        return self.blocks.cached_prefix(seq.tokens, namespace, seq.length - 1) if can_share else 0

    def _prefix_namespace(self, seq: Sequence) -> tuple[bool, Hashable | None]:
        """Whether ``seq`` may take cached blocks, and from which namespace."""
        namespace = seq.prefix_namespace(self.blocks.enable_caching)
        if (namespace is None and not self.blocks.enable_caching) or seq.wants_prompt_logprobs():
            return False, None  # prompt log-probs need the whole prompt run through the model
        return True, namespace

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Blocks whose KV is now complete become findable by later requests with the same prefix."""
        namespace = seq.prefix_namespace(self.blocks.enable_caching)
        if namespace is None and not self.blocks.enable_caching:
            return
        full = seq.num_cached // self.block_size
        if full > seq.blocks_registered:
            self.blocks.register(seq.block_table, seq.tokens, seq.blocks_registered, full - seq.blocks_registered,
                                 namespace)
            seq.blocks_registered = full
