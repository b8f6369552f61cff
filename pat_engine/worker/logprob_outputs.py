"""Per-step outputs beyond the sampled token: prompt log-probs (echo, evaluation harnesses).

The prompt log-probs of a sequence prefilled from position 0: for every prompt
token after the first, its log-probability given the tokens before it, and the
``k`` most likely alternatives at that position. Computed from the hidden
states of the prefill in chunks, so a long prompt never materialises
(prompt length x vocabulary) logits at once.
"""

from __future__ import annotations

from typing import Callable

import torch

from pat_engine.protocol import PromptLogprobs
from pat_engine.sampling.logprobs import token_logprobs, top_logprobs

CHUNK_ROWS = 256  # hidden rows turned into full-vocabulary logits at a time


def prompt_logprobs(hidden: torch.Tensor, prompt: list[int], k: int,
                    logits_of: Callable[[torch.Tensor], torch.Tensor | None]) -> PromptLogprobs | None:
    """hidden: (n, h) of the prompt's n positions; ``logits_of`` gathers full-vocab logits (None off
    the TP leader, which is where the answer goes; every rank still runs every chunk's gather)."""
    logprobs: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    targets = torch.tensor(prompt[1:], dtype=torch.long, device=hidden.device)
    leader = True
    for start in range(0, len(prompt) - 1, CHUNK_ROWS):
        stop = min(start + CHUNK_ROWS, len(prompt) - 1)
        logits = logits_of(hidden[start:stop])
        if logits is None:
            leader = False
            continue
        logprobs += token_logprobs(logits, targets[start:stop]).tolist()  # the sampler's rule, to the bit
        if k:
            values, ids = top_logprobs(logits, k)
            tops += [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return PromptLogprobs(logprobs, tops if k else None) if leader else None
