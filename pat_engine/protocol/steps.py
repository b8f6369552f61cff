"""Step messages: the hot path between the driver and the ranks of one DP group.

A prefill sends a sequence's whole block table; a decode step sends only the
last token and any block appended since, because workers keep each
sequence's table (nano-vllm sends the same minimum).

A verify step (speculative decoding, docs/speculative.md) is a decode step whose rows
may carry drafted tokens after the last one: every position of a row is sampled, and
TP rank 0 answers with the accepted tokens plus one more (``StepResult.counts``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pat_engine.sampling.spec import SamplingSpec


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
    context: list[int] | None = None  # prefill of a sequence with penalties: its tokens before start_pos
    prompt_logprobs: int | None = None  # prefill from position 0: also return prompt log-probs (top k)


@dataclass
class StepCommand:
    step_id: int
    is_prefill: bool
    seqs: list[SeqStep]
    released: list[int] = field(default_factory=list)  # sequences whose tables can be dropped
    verify: bool = False  # a decode step sampled at every position of every row (rows with drafts)
    # (seq_id, n): cut the sequence's table to its first n blocks before this step (rejected drafts' blocks)
    truncated: list[tuple[int, int]] = field(default_factory=list)


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
    forward_seconds: float  # the whole step on TP rank 0: inputs, forward, LM head, sampling
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per sequence, when any asked
    prompt_logprobs: dict[int, PromptLogprobs] | None = None  # by seq_id
    head_seconds: float = 0.0  # of forward_seconds: the LM head (logits of the sampled rows)
    sample_seconds: float = 0.0  # of forward_seconds: log-probs and the draw
    # verify steps: tokens per sequence (accepted drafts + 1); tokens, logprobs and top_logprobs then hold
    # counts[i] consecutive entries for sequence i. None: one each
    counts: list[int] | None = None
