"""A live layout change: the plan every rank runs, and what each rank reports back.

The driver builds one ``SwitchPlan`` (target layout, KV path, where each
migrated sequence's KV lands) and every rank runs it; each answers with a
``SwitchReport``, and ``SwitchReport.merge`` folds them into the cluster's
view (the slowest rank's times, bytes summed over ranks).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from pat_engine.config import KV_PATHS
from pat_engine.parallel.kv_plan import KVRun
from pat_engine.parallel.layout import Layout
from pat_engine.sampling.spec import SamplingSpec


@dataclass(frozen=True)
class SeqTable:
    """A migrated sequence as its new group's ranks must know it."""

    seq_id: int
    group: int  # new DP group
    block_table: tuple[int, ...]  # blocks of the new group's pool holding its valid tokens
    sampling: SamplingSpec
    history: tuple[int, ...] | None = None  # its tokens so far, when its sampling has logit processors


@dataclass(frozen=True)
class SwitchPlan:
    old: Layout
    new: Layout
    new_num_blocks: int  # KV blocks per rank under the new layout
    kv_path: str  # "migrate" or "recompute"
    runs: tuple[KVRun, ...] = ()  # KV that moves: each run of shared or own blocks once per target group
    tables: tuple[SeqTable, ...] = ()  # the migrated sequences' tables in their new groups
    group_requests: tuple[int, ...] = ()  # unfinished requests per new DP group (empty: not known)

    def __post_init__(self) -> None:
        if self.kv_path not in KV_PATHS:
            raise ValueError(f"kv_path must be one of {KV_PATHS}, got {self.kv_path!r}")
        if self.kv_path == "recompute" and (self.runs or self.tables):
            raise ValueError("a recompute switch migrates no KV: runs and tables must be empty")
        if self.group_requests and len(self.group_requests) != self.new.dp:
            raise ValueError(f"group_requests has {len(self.group_requests)} entries for {self.new.dp} DP groups")

    def requests_in(self, group: int) -> int | None:
        """Unfinished requests new DP group ``group`` starts with (which decode graphs it recaptures)."""
        return self.group_requests[group] if self.group_requests else None


@dataclass(frozen=True)
class SwitchReport:
    """One rank's switch, timed by phase; ``merge`` gives the same fields for the whole cluster."""

    rank: int  # -1 once merged
    group_cache_hit: bool  # the new layout's groups came from the pool's cache
    groups_s: float
    weights_s: float
    kv_s: float
    rebuild_s: float
    total_s: float
    weight_bytes_sent: int
    weight_bytes_local: int
    weight_bytes_allgather: int  # what an all-gather-and-slice would have received instead
    kv_bytes_sent: int
    peak_extra_bytes: int  # temporary memory the switch held on top of weights and KV pool
    kv_pool_bytes_before: int
    kv_pool_bytes_after: int
    busiest_kv_bytes: int  # KV bytes of the rank that sent the most, and how long its KV phase took:
    busiest_kv_s: float  # the sample a bandwidth estimate learns from
    graphs_s: float = 0.0  # restoring and capturing the decode graphs the new layout can use (0 where graphs are off)
    graphs_captured: int = 0  # how many batch sizes were captured
    graphs_restored: int = 0  # how many graphs the new layout had left on a rank before, replayed again
    graphs_left: tuple[int, ...] = ()  # batch sizes of the old layout's graphs set aside for a return to it

    @classmethod
    def for_rank(cls, rank: int, **values) -> "SwitchReport":
        return cls(rank=rank, busiest_kv_bytes=values["kv_bytes_sent"], busiest_kv_s=values["kv_s"], **values)

    @classmethod
    def merge(cls, reports: list["SwitchReport"]) -> "SwitchReport":
        """Times: the slowest rank (ranks run in parallel); bytes: summed; peak memory: the largest."""
        if not reports:
            raise ValueError("no switch reports to merge")
        busiest = max(reports, key=lambda r: r.kv_bytes_sent)
        return replace(
            reports[0],
            rank=-1,
            group_cache_hit=all(r.group_cache_hit for r in reports),
            groups_s=max(r.groups_s for r in reports),
            weights_s=max(r.weights_s for r in reports),
            kv_s=max(r.kv_s for r in reports),
            rebuild_s=max(r.rebuild_s for r in reports),
            graphs_s=max(r.graphs_s for r in reports),
            graphs_captured=max(r.graphs_captured for r in reports),  # groups capture in parallel: the most on one rank
            graphs_restored=max(r.graphs_restored for r in reports),
            graphs_left=tuple(sorted(set.intersection(*(set(r.graphs_left) for r in reports)))),  # every rank's
            total_s=max(r.total_s for r in reports),
            weight_bytes_sent=sum(r.weight_bytes_sent for r in reports),
            weight_bytes_local=sum(r.weight_bytes_local for r in reports),
            weight_bytes_allgather=sum(r.weight_bytes_allgather for r in reports),
            kv_bytes_sent=sum(r.kv_bytes_sent for r in reports),
            peak_extra_bytes=max(r.peak_extra_bytes for r in reports),
            busiest_kv_bytes=busiest.kv_bytes_sent,
            busiest_kv_s=busiest.kv_s,
        )

    def to_dict(self) -> dict:
        return asdict(self)

