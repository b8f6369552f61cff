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

Async scheduling (docs/async_scheduling.md): while a decode step is in flight, the step after it
can be built already (``schedule_following``): every sequence one position further, its token the
one the step in flight draws for it. It is built only when it is the decode step the synchronous
schedule would run next, give or take the sequences the in-flight step will end by a stop token
(their row runs once more, its token is dropped): no prefill could start now (nobody waits, or the
blocks and the sequence limit keep the waiting out) and no block has to be taken from anyone.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Hashable

from pat_engine.core.block_pool import BlockPool, blocks_needed
from pat_engine.core.request import Sequence, SeqStatus
from pat_engine.protocol import PENDING_TOKEN, SeqStep, StepCommand, StepResult

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

    def schedule_following(self, prev: StepCommand, prev_batch: list[Sequence],
                           hold: bool = False) -> tuple[StepCommand, list[Sequence]] | None:
        """The decode step after ``prev`` (a decode step in flight), built before its tokens are known;
        None where it might not be the synchronous schedule's next step, or nothing would run."""
        if sum(not s.finished for s in prev_batch) != len(self.running) or self.can_admit_now():
            return None  # someone runs who is not in ``prev``, or a prefill may start: it goes first
        rows = [r for r, seq in enumerate(prev_batch) if not seq.finished and not seq.ends_by_length(pending=1)]
        if not rows:
            return None
        # position seq.length (the token in flight) is written by this step
        need = [blocks_needed(prev_batch[r].length + 1, self.block_size) - len(prev_batch[r].block_table) for r in rows]
        if not self.blocks.can_allocate(sum(n for n in need if n > 0)):
            return None  # the synchronous schedule would preempt someone
        steps, batch = [], []
        for r, n in zip(rows, need):
            seq = prev_batch[r]
            if n > 0:
                seq.block_table += self.blocks.allocate(n)
            steps.append(SeqStep(seq.seq_id, [PENDING_TOKEN], seq.length, new_blocks=seq.block_table[seq.blocks_sent:],
                                 suppressed=seq.suppressed_now(pending=1), drawn_row=r))
            seq.blocks_sent = len(seq.block_table)
            batch.append(seq)
        self.decode_steps += 1
        return self._new_command(False, steps, follows=prev.step_id, hold=hold), batch

    def can_admit_now(self) -> bool:
        """Whether a prefill step would admit a waiting sequence now (read-only): the first one not
        held for its sibling's prefill, if the sequence limit and the free blocks allow it."""
        if len(self.running) >= self.max_num_seqs:
            return False
        seq = next((s for s in self.waiting if not s.waits_for_sibling()), None)
        if seq is None:
            return False
        cached = self.cached_tokens(seq) // self.block_size
        return self.blocks.can_allocate(blocks_needed(seq.length, self.block_size) - cached)

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
                                     suppressed=seq.suppressed_now(), allowed=seq.allowed_now(),
                                     context=tokens[:seq.num_cached] if seq.sampling.has_penalties else None,
                                     prompt_logprobs=seq.params.prompt_logprobs if seq.wants_prompt_logprobs() else None))
            else:
                steps.append(SeqStep(seq.seq_id, [seq.last_token] + drafts.get(seq.seq_id, []), seq.length - 1,
                                     new_blocks=seq.block_table[seq.blocks_sent:], suppressed=seq.suppressed_now(),
                                     allowed=seq.allowed_now()))
            seq.blocks_sent = len(seq.block_table)
        return self._new_command(is_prefill, steps, verify=bool(drafts))

    def _new_command(self, is_prefill: bool, steps: list[SeqStep], **flags) -> StepCommand:
        """The next step id, with the tables to drop and cut that the workers have not been told yet."""
        self._step_id += 1
        released, self._released = self._released, []
        truncated, self._truncated = self._truncated, []
        return StepCommand(self._step_id, is_prefill, steps, released, truncated=truncated, **flags)

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
