"""Token sampling that gives the same draw under every layout.

Each draw uses one uniform number that depends only on ``(seed, position)``
(a SplitMix64 hash), so a request sampled under TP1xDP4, TP4xDP1 or after a
recompute picks the same token: the logits are the same, and so is the
random number. Greedy is argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of a request seeded ``seed`` (sample 0 keeps ``seed``)."""
    if sample_index == 0:
        return seed
    return _splitmix64((seed & _MASK64) ^ _splitmix64(sample_index)) >> 1


def uniform_for(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) that is a pure function of (seed, position)."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ position) >> 11) * 2.0**-53


@dataclass(frozen=True)
class SamplingSpec:
    """What a worker needs to sample one sequence (sent once per admission)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: bool
    processed_logprobs: bool = False  # log-prob under the distribution sampled from, not the raw logits
    top_logprobs: int = 0  # also report the k most likely tokens and their log-probs
    repetition_penalty: float = 1.0  # logit processors (sampling/processors.py)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_len: int = 0  # where the output starts in the sequence (frequency and presence count the output)

    @property
    def has_processors(self) -> bool:
        """Whether logits change before sampling (then the worker keeps the sequence's token history)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias) or self.min_p != 0.0)


def _sample_row(logits: torch.Tensor, spec: SamplingSpec, position: int) -> tuple[int, float]:
    """The drawn token and its log-probability after temperature, top-k and top-p."""
    probs = torch.softmax(logits.to(torch.float64) / spec.temperature, dim=-1)
    probs, order = probs.sort(descending=True, stable=True)
    keep = probs.numel()
    if spec.top_k > 0:
        keep = min(keep, spec.top_k)
    if spec.top_p < 1.0:
        # smallest prefix whose mass reaches top_p (always at least one token)
        cum = probs.cumsum(0)
        keep = min(keep, int((cum < spec.top_p).sum().item()) + 1)
    probs = probs[:keep]
    cum = probs.cumsum(0)
    target = uniform_for(spec.seed, position) * cum[-1].item()
    index = min(int((cum <= target).sum().item()), keep - 1)
    return int(order[index]), float(torch.log(probs[index] / cum[-1]))


def sample(
    logits: torch.Tensor,
    specs: list[SamplingSpec],
    positions: list[int],
    suppressed: list[tuple[int, ...]] | None = None,
) -> tuple[list[int], list[float] | None]:
    """logits: (B, vocab). ``positions[i]`` is the index the new token will take in its sequence.

    ``suppressed[i]`` lists token ids row ``i`` may not pick (EOS before ``min_new_tokens``).
    """
    if suppressed and any(suppressed):
        logits = logits.clone()
        for i, ids in enumerate(suppressed):
            if ids:
                logits[i, list(ids)] = float("-inf")
    greedy = logits.argmax(dim=-1).tolist()
    tokens, processed = [], {}
    for i, spec in enumerate(specs):
        if spec.temperature == 0.0:
            tokens.append(greedy[i])
        else:
            token, processed[i] = _sample_row(logits[i], spec, positions[i])
            tokens.append(token)
    if not any(s.logprobs for s in specs):
        return tokens, None
    raw = torch.log_softmax(logits.to(torch.float64), dim=-1)
    chosen = raw[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    for i, spec in enumerate(specs):  # greedy rows have no processing: raw and processed agree
        if spec.processed_logprobs and i in processed:
            chosen[i] = processed[i]
    return tokens, chosen
