"""How many worker restarts the engine may make: a rate (N per sliding window), not a lifetime count.

A server that runs for weeks survives an occasional crash; a crash loop
(every restart failing again at once) uses the window's allowance up and
the engine declares itself unable to serve, instead of restarting forever.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable


class RestartBudget:
    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._times: deque[float] = deque()
        self._lock = threading.Lock()  # /health reads it while the engine loop spends from it

    def _forget_old(self) -> None:
        horizon = self._clock() - self.window_s
        while self._times and self._times[0] <= horizon:
            self._times.popleft()

    def recent(self) -> int:
        """Restarts made within the last ``window_s`` seconds."""
        with self._lock:
            self._forget_old()
            return len(self._times)

    def take(self) -> bool:
        """Spend one restart if the window allows it; False when the allowance is used up."""
        with self._lock:
            self._forget_old()
            if len(self._times) >= self.max_restarts:
                return False
            self._times.append(self._clock())
            return True

    def describe(self) -> str:
        return f"{self.max_restarts} restarts per {self.window_s:g}s"
