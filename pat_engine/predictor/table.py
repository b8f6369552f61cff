"""The versioned latency table written by ``pat-profile`` and read by the predictor.

One JSON file per deployment::

    {"schema": "pat-profile-table", "version": 1,
     "deployment": {model fingerprint, dtype, device, world, candidate tps, block size,
                    threads per worker (CPU), library versions, emulated + collective model},
     "model": {num_layers, num_kv_heads, head_dim, elt_bytes, ...},   # for the KV-bytes estimate
     "points": [{tp, batch_size, context_len, total_tokens, prefill_s, decode_step_s, ...}],
     "bandwidth_bytes_per_s": one-way per-rank bytes/s of the reshard collectives,
     "switch_costs": [{from_tp, to_tp, fixed_s, weight_bytes, graphs_s_per_size, ...}],
     "meta": {command, created, profile_seconds, notes}}

``batch_size`` is per DP group; ``total_tokens`` is the mean total context of
the group's batch over the decode window (what the latency fit is keyed on).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from pat_engine.errors import PatEngineError
from pat_engine.parallel.kv_plan import kv_bytes_per_token

log = logging.getLogger(__name__)

SCHEMA = "pat-profile-table"
SCHEMA_VERSION = 1

# Fields that change step latency: a table measured under other values is refused.
CHECKED_FIELDS = ("model_fingerprint", "dtype", "device", "world", "block_size", "threads_per_worker")
LATENCY_LIBRARIES = ("torch", "triton", "pat-engine")  # a new version may move step times: a warning


class ProfileTableError(PatEngineError, ValueError):
    """A profile table cannot be read, or was measured for another deployment."""


@dataclass(frozen=True)
class Deployment:
    model_fingerprint: str
    model_name: str  # informational (directory name); not checked
    dtype: str
    device: str  # "cpu: <cpu model> (<n> cores)" or "cuda: <gpu name>"
    world: int
    candidate_tps: tuple[int, ...]
    block_size: int
    threads_per_worker: int | None = None  # CPU: torch threads per worker; None on GPU
    libraries: dict = field(default_factory=dict)  # versions of LATENCY_LIBRARIES (older tables: transformers too)
    emulated: bool = False  # per-rank shard timed on one device + the collective model below
    collective_model: dict | None = None

    def mismatches(self, other: "Deployment") -> list[str]:
        """Checked fields that differ, each as 'name: table=... engine=...'."""
        out = []
        for name in CHECKED_FIELDS:
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"{name}: table={a!r} engine={b!r}")
        return out

    def library_differences(self, other: "Deployment") -> list[str]:
        """The libraries that compute a step whose versions differ (an older table's transformers, which only
        loads the config, is not one of them; nor is a library one side did not record)."""
        keys = [k for k in LATENCY_LIBRARIES if k in self.libraries and k in other.libraries]
        return [f"{k}: table={self.libraries[k]} engine={other.libraries[k]}"
                for k in keys if self.libraries[k] != other.libraries[k]]


@dataclass(frozen=True)
class ModelShape:
    """What the KV-migration estimate needs (paper Eq. 1): layers, KV heads, head dim, bytes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    elt_bytes: int
    weight_bytes: int = 0  # whole model, informational

    def kv_bytes_per_token_per_rank(self, tp: int) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.elt_bytes, tp)


@dataclass(frozen=True)
class ProfilePoint:
    tp: int
    batch_size: int  # per DP group
    context_len: int  # prompt length of every request in the dummy batch
    total_tokens: float  # mean total context of the group's batch over the decode window
    prefill_s: float  # one group's prefill of the whole batch (all groups ran at once)
    decode_step_s: float  # median decode step latency over the window
    decode_step_std_s: float = 0.0
    steps: int = 0  # decode steps averaged
    repeat: int = 0  # which pass over the grid measured it (pat-profile --passes); fits average the passes

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.tp, self.batch_size, self.context_len)

    @property
    def run_key(self) -> tuple[int, int, int, int]:
        return (*self.key, self.repeat)


@dataclass(frozen=True)
class SwitchCost:
    """Measured (or calibrated) cost of one layout change that does not scale with the batch."""

    from_tp: int
    to_tp: int
    fixed_s: float  # groups (cached), rebuild, bookkeeping: total minus weights, KV and graph capture
    weight_bytes: int  # busiest sender's reshard bytes (from the plan)
    weights_s: float | None = None  # measured weight reshard time, if any
    groups_first_s: float | None = None  # group creation on first use (cached afterwards)
    # capturing one decode graph under to_tp (0: graphs off, or a table from before they existed); a switch
    # pays it for each ladder size its busiest new DP group can still use (predictor.graph_seconds)
    graphs_s_per_size: float = 0.0


@dataclass
class ProfileTable:
    deployment: Deployment
    model: ModelShape
    points: list[ProfilePoint] = field(default_factory=list)
    bandwidth_bytes_per_s: float | None = None
    switch_costs: list[SwitchCost] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    # ---- queries ---------------------------------------------------------------------------

    def tps(self) -> list[int]:
        return sorted({p.tp for p in self.points})

    def done_keys(self) -> set[tuple[int, int, int, int]]:
        return {p.run_key for p in self.points}

    def add_point(self, point: ProfilePoint) -> None:
        self.points = [p for p in self.points if p.run_key != point.run_key] + [point]

    def switch_cost(self, from_tp: int, to_tp: int) -> SwitchCost | None:
        for c in self.switch_costs:
            if (c.from_tp, c.to_tp) == (from_tp, to_tp):
                return c
        return None

    # ---- files -----------------------------------------------------------------------------

    def to_dict(self) -> dict:
        dep = asdict(self.deployment)
        dep["candidate_tps"] = list(self.deployment.candidate_tps)
        return {
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "deployment": dep,
            "model": asdict(self.model),
            "points": [asdict(p) for p in sorted(self.points, key=lambda p: p.run_key)],
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "switch_costs": [asdict(c) for c in self.switch_costs],
            "meta": self.meta,
        }

    def save(self, path: str | Path) -> None:
        """Write atomically (temp file + rename), so an interrupted run never leaves half a table."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)

    @classmethod
    def from_dict(cls, data: dict, where: str = "table") -> "ProfileTable":
        if data.get("schema") != SCHEMA:
            raise ProfileTableError(f"{where}: not a pat-profile table (schema={data.get('schema')!r})")
        if data.get("version") != SCHEMA_VERSION:
            raise ProfileTableError(f"{where}: table version {data.get('version')} but this pat-engine reads "
                                    f"version {SCHEMA_VERSION}; profile again")
        try:
            dep = dict(data["deployment"])
            dep["candidate_tps"] = tuple(dep["candidate_tps"])
            return cls(
                deployment=Deployment(**_known(Deployment, dep)),
                model=ModelShape(**_known(ModelShape, data["model"])),
                points=[ProfilePoint(**_known(ProfilePoint, p)) for p in data.get("points", [])],
                bandwidth_bytes_per_s=data.get("bandwidth_bytes_per_s"),
                switch_costs=[SwitchCost(**_known(SwitchCost, c)) for c in data.get("switch_costs", [])],
                meta=dict(data.get("meta", {})),
            )
        except (KeyError, TypeError) as exc:
            raise ProfileTableError(f"{where}: malformed table ({exc})") from None

    @classmethod
    def load(cls, path: str | Path) -> "ProfileTable":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ProfileTableError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data, str(path))


def _known(cls, data: dict) -> dict:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def check_deployment(table: ProfileTable, engine_dep: Deployment, base_tp: int, where: str = "profile table") -> None:
    """Refuse a table measured for another deployment; warn when only library versions differ."""
    problems = table.deployment.mismatches(engine_dep)
    if base_tp not in table.tps():
        problems.append(f"candidate_tps: table has no points for the engine's base tp={base_tp} "
                        f"(table tps {table.tps()})")
    if problems:
        raise ProfileTableError(f"{where} was measured for another deployment; differing fields: "
                                + "; ".join(problems) + ". Run pat-profile for this deployment.")
    libs = table.deployment.library_differences(engine_dep)
    if libs:
        # Library updates can move latencies a little; refusing would force a re-profile on every patch release.
        log.warning("%s: library versions differ (%s); latencies may have shifted", where, "; ".join(libs))
    if table.deployment.emulated:
        log.info("%s is emulated (one device + collective model %s)", where, table.deployment.collective_model)
