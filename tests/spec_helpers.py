"""Proposers for speculative-decoding tests: drafts that are right (forced acceptances) or wrong."""

from __future__ import annotations

import random


class ReplayProposer:
    """Drafts what a reference run generated for the same (prompt, sample index), a share ``wrong``
    of the tokens replaced by another id (rejections at random places)."""

    def __init__(self, reference: dict[tuple[tuple[int, ...], int], list[int]], wrong: float, seed: int = 0,
                 vocab: int = 300):
        self.reference, self.wrong, self.rng, self.vocab = reference, wrong, random.Random(seed), vocab

    def track(self, seq) -> None: ...

    def release(self, seq) -> None: ...

    def propose(self, seq, k: int) -> list[int]:
        ref = self.reference.get((tuple(seq.prompt_ids), seq.sample_index), [])
        draft = ref[len(seq.output_ids) : len(seq.output_ids) + k]
        return [(t + 1) % self.vocab if self.rng.random() < self.wrong else t for t in draft]
