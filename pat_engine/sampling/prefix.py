"""top_k / top_p in torch: each row's kept prefix of the tokens by descending logit (ties: lower id
first), found with a partial ``topk`` instead of a sort, and the row masked to it.

This is the general path (other devices, float64, ``PAT_CPU_SAMPLER=torch``); the CPU kernel
(``inverse_cdf_prefix_cpu`` in csrc/pat_kernels/cpu/sample.cpp) finds the same prefix and draws
the same token, bit for bit (tests/test_sampler.py). On a GPU (``host.reads_are_free`` false) the
candidates are the whole sorted row, found without reading a value on the host; the kept prefix is
the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pat_engine.sampling import host
from pat_engine.sampling.inverse_cdf import lane_sum, nucleus_sizes, weights


def descending(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row in the order of a stable descending sort (``k`` = 0: all)."""
    vocab = probs.shape[-1]
    if k <= 0 or k >= vocab:
        return probs.sort(dim=-1, descending=True, stable=True)
    values, order = probs.topk(k, dim=-1, sorted=False)
    # a stable sort puts equal values by ascending id: sort the candidates by id, then stably by value
    order, by_id = order.sort(dim=-1)
    values = values.gather(-1, by_id)
    values, by_value = values.sort(dim=-1, descending=True, stable=True)
    order = order.gather(-1, by_value)
    # a tie across the k-th place may have let topk keep a larger id than the stable sort would
    ties = (probs >= values[:, -1:]).sum(dim=-1) > k
    if bool(ties.any()):
        full_values, full_order = probs[ties].sort(dim=-1, descending=True, stable=True)
        values[ties], order[ties] = full_values[:, :k], full_order[:, :k]
    return values, order


@dataclass
class Prefix:
    """The top_k / top_p rows' kept tokens: ``order[:, :keep]`` (stable descending logits)."""

    rows: torch.Tensor  # int64: which sampled rows these are
    order: torch.Tensor  # (F, width) token ids by descending logit, ties by lower id
    keep: torch.Tensor  # (F,) how many of them are kept


def prefixes(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, inv_temp: torch.Tensor,
             index: torch.Tensor, any_top_p: bool) -> Prefix:
    """Each top_k / top_p row's kept prefix (top_k: int64 (S,), <= 0 off; top_p: (S,), >= 1 off).

    ``index``: the rows that have either (the caller knows them from the requests' settings);
    ``any_top_p``: whether one of them has top_p. On the CPU the prefix is read off a partial
    ``topk``: for top_p the candidate count comes from ``nucleus_bound`` and grows if the prefix's
    mass (the kernel's weights, over the row's whole Z) has not reached top_p, so no row is sorted
    whole unless its nucleus needs it. On a GPU every row is sorted whole: no value read on the host."""
    vocab = x.shape[1]
    top_p = top_p.to(torch.float64)
    xf = x.index_select(0, index).float()
    k_cap = torch.where(top_k[index] > 0, top_k[index].clamp(max=vocab), vocab)
    p, it = top_p[index], inv_temp[index]
    need, z_sum, e = k_cap, None, None
    if any_top_p:
        no_floor = torch.full_like(it, float("-inf"))
        e, m = weights(xf, it, no_floor)
        z_sum = lane_sum(e)  # inverse_cdf's Z: the same weights in the same order, without a second pass
        if host.reads_are_free(x):
            need = torch.where(p < 1.0, torch.minimum(k_cap, nucleus_bound(xf, m, it, p, z_sum)), k_cap)

    def kept(order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(tokens kept of the ``order`` candidates, the top_p count or None)."""
        width = order.shape[-1]
        keep = k_cap.clamp(max=width)
        if z_sum is None:
            return keep, None
        nucleus = nucleus_sizes(e.gather(1, order), p, z_sum)
        return torch.where(p < 1.0, torch.minimum(keep, nucleus), keep).clamp(max=width), nucleus

    if not host.reads_are_free(x):  # every row sorted whole: nothing read on the host
        order = descending(xf, 0)[1]
        return Prefix(index, order, kept(order)[0])
    width = int(need.max())
    while True:
        order = descending(xf, width if width < vocab else 0)[1]
        keep, nucleus = kept(order)
        # a row whose top_p prefix may run past the candidates needs more of them
        if nucleus is None or width >= vocab or not bool(((p < 1.0) & (nucleus > width) & (k_cap > width)).any()):
            break
        width = min(vocab, width * 4)
    return Prefix(index, order, keep)


def masked(x: torch.Tensor, prefix: Prefix) -> torch.Tensor:
    """The prefix rows of ``x`` with every token outside the kept prefix at -inf: the kernel then
    draws among the kept tokens alone (a masked token's weight is 0 and changes no sum)."""
    width = prefix.order.shape[1]
    within = torch.arange(width, device=x.device) < prefix.keep.unsqueeze(1)
    rows = x.index_select(0, prefix.rows)
    kept = torch.full_like(rows, float("-inf"))
    return kept.scatter_(1, prefix.order, torch.where(within, rows.gather(1, prefix.order), kept.gather(1, prefix.order)))


def nucleus_bound(xf: torch.Tensor, m: torch.Tensor, inv_temp: torch.Tensor, top_p: torch.Tensor,
                   z_sum: torch.Tensor) -> torch.Tensor:
    """How many candidates hold each row's top_p prefix (int64), from a histogram instead of a sort.

    A token's weight is about 2**b with b = floor(z * log2(e)); counting the tokens per b gives, from
    the top, a lower bound of the mass above each b. The prefix lies among the tokens at or above
    the first b whose bound reaches top_p * Z, taken one b lower against rounding. (Only the
    candidate count comes from here; the prefix itself is found exactly in ``_restrict``.)
    """
    levels = 128
    b = ((xf - m) * (inv_temp * 1.4426950408889634).unsqueeze(1)).floor().clamp(min=1 - levels, max=0)
    idx = (b + (levels - 1)).long()  # 0 (weight ~2**-127) .. levels - 1 (weight ~1)
    counts = torch.zeros(xf.shape[0], levels, dtype=torch.float64, device=xf.device).scatter_add_(
        1, idx, torch.ones_like(idx, dtype=torch.float64))
    scale = torch.pow(2.0, torch.arange(1 - levels, 1, dtype=torch.float64, device=xf.device))
    mass_above = (counts * scale * 0.999).flip(1).cumsum(1).flip(1)  # bound of the mass at level >= b
    need = (top_p * z_sum).unsqueeze(1)
    first = ((mass_above >= need).sum(dim=1) - 2).clamp(min=0)  # highest level whose bound reaches need, less one
    return counts.flip(1).cumsum(1).flip(1).gather(1, first.unsqueeze(1)).squeeze(1).long()
