"""Where unfinished requests go when a switch changes the number of DP groups.

One rule, used by the switch itself and by the predictor that prices it (so a
predicted placement is the placement the switch makes): longest context first
onto the group with the fewest context tokens (ties: fewest requests, then the
lowest group), requests of equal length in the order given.
"""

from __future__ import annotations

from typing import Sequence

Placement = list[list[int]]  # per DP group, indices into the request list


def balance_by_context(contexts: Sequence[int], groups: int) -> Placement:
    load = [0] * groups
    count = [0] * groups
    out: Placement = [[] for _ in range(groups)]
    for i in sorted(range(len(contexts)), key=lambda i: (-contexts[i], i)):
        g = min(range(groups), key=lambda j: (load[j], count[j], j))
        out[g].append(i)
        load[g] += contexts[i]
        count[g] += 1
    return out
