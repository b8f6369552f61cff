"""Record of layouts, load and switches over time, for pat-serve plots and benchmarks.

Both records are ring buffers: a server that runs for weeks keeps the most
recent ``max_events`` of each, so ``/pat/timeline`` stays bounded.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field


@dataclass
class StatusPoint:
    t: float  # seconds since the engine started
    layout: str
    active: int  # unfinished requests
    tokens_per_s: float


@dataclass
class SwitchEvent:
    t: float
    from_layout: str
    to_layout: str
    reason: str
    kv_path: str  # "migrate" or "recompute"
    seconds: float
    costs: dict = field(default_factory=dict)  # seconds by component, bytes moved, peak extra memory
    decision: dict = field(default_factory=dict)  # predicted remaining times when a controller decided
    ok: bool = True
    error: str | None = None


class Timeline:
    def __init__(self, max_events: int = 10_000) -> None:
        self.t0 = time.time()
        self.points: deque[StatusPoint] = deque(maxlen=max_events)
        self.switches: deque[SwitchEvent] = deque(maxlen=max_events)
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.time() - self.t0

    def add_point(self, layout: str, active: int, tokens_per_s: float) -> None:
        with self._lock:
            self.points.append(StatusPoint(self.now(), layout, active, tokens_per_s))

    def add_switch(self, event: SwitchEvent) -> None:
        with self._lock:
            self.switches.append(event)

    def to_dict(self) -> dict:
        with self._lock:
            return {
                "t0": self.t0,
                "points": [asdict(p) for p in self.points],
                "switches": [asdict(s) for s in self.switches],
            }
