"""Where unfinished requests go when a switch changes the number of DP groups.

``switch_placement`` is the one entry point, called by the switch itself and by the
controller that prices it (so a predicted placement is the placement the switch makes).
With an admission placement installed that can ``rebalance`` (a ``RebalancingPlacement``),
it decides; otherwise
``balance_by_context``: longest context first onto the group with the fewest context tokens
(ties: fewest requests, then the lowest group), requests of equal length in the order given.

The placement rules are swappable (``Engine.set_placement``); their interfaces live here, where
the switch consults them. Types of the driver side (``core.request.Sequence``,
``core.scheduler.GroupScheduler``, ``predictor.policy.RequestSnapshot``) are named in the
docstrings only: this package imports neither.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

Placement = list[list[int]]  # per DP group, indices into the request list


@runtime_checkable
class PlacementRule(Protocol):
    """The coordinator's admission placement: the DP group of each request as it is admitted."""

    def __call__(self, seq: Any, schedulers: Sequence[Any]) -> int:
        """Args:
            seq: the ``Sequence`` being admitted (a prompt's other samples follow it into its group).
            schedulers: every DP group's ``GroupScheduler``, by group index (their ``unfinished()``).
        Returns:
            The group index.
        """
        ...


@runtime_checkable
class RebalancingPlacement(PlacementRule, Protocol):
    """An admission placement that also re-places unfinished requests when a switch changes the groups."""

    def rebalance(self, requests: Sequence[Any], groups: int) -> Placement:
        """Args:
            requests: the unfinished requests' ``RequestSnapshot``s, in ``seq_id`` order.
            groups: the number of DP groups of the target layout.
        Returns:
            Per group, indices into ``requests``; each request in exactly one group.
        """
        ...


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


def switch_placement(rule: PlacementRule | None, requests: Sequence[Any], groups: int) -> Placement:
    """Per new DP group, indices into ``requests`` (``RequestSnapshot``s).

    ``rule``: the coordinator's admission placement (or None). Requests are presented to the
    rule in ``seq_id`` order whatever order the caller holds them in, so the switch (which
    holds them by arrival) and the controller (which holds them group by group) agree.
    """
    order = sorted(range(len(requests)), key=lambda i: requests[i].seq_id)
    ordered = [requests[i] for i in order]
    rebalance = getattr(rule, "rebalance", None)
    placed = (rebalance(ordered, groups) if rebalance is not None
              else balance_by_context([r.context_len for r in ordered], groups))
    return [[order[k] for k in members] for members in placed]
