"""Step messages: the hot path between the driver and the ranks of one DP group.

A prefill sends a sequence's whole block table; a decode step sends only the
last token and any block appended since, because workers keep each
sequence's table (nano-vllm sends the same minimum).

A verify step (speculative decoding, docs/speculative.md) is a decode step whose rows
may carry drafted tokens after the last one: every position of a row is sampled, and
TP rank 0 answers with the accepted tokens plus one more (``StepResult.counts``).

Async scheduling (docs/async_scheduling.md): a decode step may be sent before the step it
``follows`` has been answered. Its rows' tokens are not known to the driver yet: each row names the
row of the followed step whose draw it runs (``SeqStep.drawn_row``), and the ranks take that token from
the draw still on the device. A step sent with ``hold`` is answered once the rank has read its next
message (the step that follows it, launched first, or ``AnswerHeld``), so a GPU never waits for the
driver between the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pat_engine.sampling.spec import SamplingSpec
from pat_engine.sampling.structured import TokenMask


@dataclass
class SeqStep:
    seq_id: int
    token_ids: list[int]  # tokens to run now: the uncached suffix (prefill), the last token (decode), the last
    # token and its draft (verify)
    start_pos: int  # tokens of this sequence already in the KV cache
    block_table: list[int] | None = None  # prefill: the full table (replaces any old one)
    new_blocks: list[int] = field(default_factory=list)  # decode: blocks appended since last step
    sampling: SamplingSpec | None = None  # prefill: how to sample this sequence
    suppressed: tuple[int, ...] = ()  # token ids not allowed this step (EOS before min_new_tokens)
    allowed: TokenMask | None = None  # structured output: the tokens this draw may take (core/grammar.py)
    context: list[int] | None = None  # prefill of a sequence with penalties: its tokens before start_pos
    prompt_logprobs: int | None = None  # prefill from position 0: also return prompt log-probs (top k)
    drawn_row: int | None = None  # a step that follows another: the row of that step whose draw is this
    # row's token (``token_ids`` then holds ``PENDING_TOKEN``)


PENDING_TOKEN = -1  # a token drawn by a step whose answer the driver has not read yet (``SeqStep.drawn_row``)


@dataclass
class StepCommand:
    step_id: int
    is_prefill: bool
    seqs: list[SeqStep]
    released: list[int] = field(default_factory=list)  # sequences whose tables can be dropped
    verify: bool = False  # a decode step sampled at every position of every row (rows with drafts)
    # (seq_id, n): cut the sequence's table to its first n blocks before this step (rejected drafts' blocks)
    truncated: list[tuple[int, int]] = field(default_factory=list)
    follows: int | None = None  # sent before step ``follows`` of this group was answered: rows run its draw
    hold: bool = False  # answer only after the next message for this group arrived (it follows, or releases)


@dataclass
class AnswerHeld:
    """No step follows ``step_id`` for now: a rank holding its answer (``StepCommand.hold``) sends it."""

    step_id: int


@dataclass
class PromptLogprobs:
    logprobs: list[float]  # for prompt tokens 1..n-1 (token 0 has none)
    top: list[list[tuple[int, float]]] | None  # per position, the k most likely (id, log-prob)


@dataclass
class StepResult:
    step_id: int
    group: int
    tokens: list[int]
    logprobs: list[float] | None
    forward_seconds: float  # the whole step on TP rank 0: inputs, forward, LM head, sampling (held: to its answer)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per sequence, when any asked
    prompt_logprobs: dict[int, PromptLogprobs] | None = None  # by seq_id
    head_seconds: float = 0.0  # of forward_seconds: the LM head (logits of the sampled rows)
    sample_seconds: float = 0.0  # of forward_seconds: log-probs and the draw
    # verify steps: tokens per sequence (accepted drafts + 1); tokens, logprobs and top_logprobs then hold
    # counts[i] consecutive entries for sequence i. None: one each
    counts: list[int] | None = None
