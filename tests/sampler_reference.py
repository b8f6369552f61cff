"""The per-row sampler the batched one replaced, kept as the reference its tokens must equal."""

from __future__ import annotations

import torch

from pat_engine.sampling.sampler import SamplingSpec, uniform_for


def reference_row(logits: torch.Tensor, spec: SamplingSpec, position: int) -> tuple[int, float]:
    """The drawn token and its log-probability after temperature, top-k and top-p (one row)."""
    probs = torch.softmax(logits.to(torch.float64) / spec.temperature, dim=-1)
    probs, order = probs.sort(descending=True, stable=True)
    keep = probs.numel()
    if spec.top_k > 0:
        keep = min(keep, spec.top_k)
    if spec.top_p < 1.0:
        cum = probs.cumsum(0)
        keep = min(keep, int((cum < spec.top_p).sum().item()) + 1)
    probs = probs[:keep]
    cum = probs.cumsum(0)
    target = uniform_for(spec.seed, position) * cum[-1].item()
    index = min(int((cum <= target).sum().item()), keep - 1)
    return int(order[index]), float(torch.log(probs[index] / cum[-1]))


def reference_sample(logits, specs, positions, suppressed=None):
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
            token, processed[i] = reference_row(logits[i], spec, positions[i])
            tokens.append(token)
    if not any(s.logprobs for s in specs):
        return tokens, None
    raw = torch.log_softmax(logits.to(torch.float64), dim=-1)
    chosen = raw[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    for i, spec in enumerate(specs):
        if spec.processed_logprobs and i in processed:
            chosen[i] = processed[i]
    return tokens, chosen
