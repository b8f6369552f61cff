"""Fault injection for tests: make the next pass through a named point raise, hang, or kill the process."""

from __future__ import annotations

import os
import time

FAULT_KINDS = ("raise", "hang", "exit")


class FaultInjector:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._armed: dict[str, str] = {}  # where -> kind

    def arm(self, where: str, how: str = "raise") -> None:
        if how not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {how!r}")
        self._armed[where] = how

    def check(self, where: str) -> None:
        """Called at each injection point; fires (once) when ``where`` is armed."""
        how = self._armed.pop(where, None)
        if how == "exit":
            os._exit(17)
        if how == "hang":
            time.sleep(3600)
        if how == "raise":
            raise RuntimeError(f"injected fault at {where} on rank {self.rank}")
