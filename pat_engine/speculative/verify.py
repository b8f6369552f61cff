"""Acceptance of drafted tokens on TP rank 0: the worker's half of speculative decoding.

A verify step samples every position of a row with the sampler's own rule (the same spec,
seed, sample index and position as a decode step there), so ``sampled[j]`` is the token
plain decoding would pick at position ``start + 1 + j`` *if* the tokens before it are the
ones decoding would have produced. That holds for ``j = 0`` and, inductively, for every
``j`` whose draft tokens before it all equal the sampled ones. So the row keeps
``sampled[0..a]``, where ``a`` is the length of the longest draft prefix that equals the
sampled tokens: ``a`` accepted drafts, then the sampler's token at the first mismatch (or
after the last draft) as the bonus token. Log-probs and top log-probs of the kept rows
are the sampler's numbers for those positions.
"""

from __future__ import annotations

from collections.abc import Sequence

from pat_engine.sampling.sampler import Sampled


def accepted_length(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading draft tokens equal the sampled tokens (``sampled`` has ``len(draft) + 1``)."""
    a = 0
    while a < len(draft) and sampled[a] == draft[a]:
        a += 1
    return a


def accept(drafts: Sequence[Sequence[int]], out: Sampled) -> tuple[Sampled, list[int]]:
    """Keep each row's accepted tokens plus the bonus token.

    Args:
        drafts: per sequence of the step, its drafted tokens (possibly none).
        out: the sampler's answer for ``len(draft) + 1`` consecutive rows per sequence.
    Returns:
        the kept rows (tokens, and log-probs / top log-probs when asked) and the count per sequence.
    """
    keep: list[int] = []
    counts: list[int] = []
    row = 0
    for draft in drafts:
        n = accepted_length(draft, out.tokens[row : row + len(draft) + 1]) + 1
        keep.extend(range(row, row + n))
        counts.append(n)
        row += len(draft) + 1

    def pick(values: list | None) -> list | None:
        return None if values is None else [values[r] for r in keep]

    return Sampled(pick(out.tokens), pick(out.logprobs), pick(out.top)), counts
