"""Poison isolation: the requests of a step that crashed a worker are replayed one at a time.

After a worker failure the requests that were in the failing step are
suspects (a "strike"). They are held back from the schedulers and let in
again one at a time: the next one only once the current one has got past
the length at which it crashed (or finished). A suspect that is in a
failing step a second time is the poison and is failed alone with a clear
error; the innocent ones clear their strike by getting past their crash
point. So a request that makes every step it is in crash is failed after
two restarts, and a replay never repeats a crash forever.

The loop thread owns this object (no locks), as it owns the coordinator.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pat_engine.core.request import Sequence

POISON_STRIKES = 2  # failing steps a request may be in before it is failed alone


@dataclass
class _Strike:
    count: int
    crash_length: int  # prompt + output tokens when its step last failed


class Quarantine:
    def __init__(self) -> None:
        self._strikes: dict[int, _Strike] = {}
        self._parked: deque[Sequence] = deque()
        self._probation: Sequence | None = None  # the one suspect let back in, not yet past its crash point

    def on_crash(self, suspects: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """Record a failing step; returns (poison: fail these now, held: park these until their turn)."""
        poison, held = [], []
        for seq in suspects:
            st = self._strikes.get(seq.seq_id)
            st = _Strike(1, seq.length) if st is None else _Strike(st.count + 1, seq.length)
            if st.count >= POISON_STRIKES:
                self._strikes.pop(seq.seq_id, None)
                poison.append(seq)
            else:
                self._strikes[seq.seq_id] = st
                held.append(seq)
            if self._probation is seq:
                self._probation = None
        return poison, held

    def park(self, seqs: list[Sequence]) -> None:
        self._parked.extend(sorted(seqs, key=lambda s: s.seq_id))

    def next_to_admit(self) -> Sequence | None:
        """The next held request to let in, when the one on probation has proven itself (or there is none)."""
        prob = self._probation
        if prob is not None:
            st = self._strikes.get(prob.seq_id)
            if not prob.finished and st is not None and prob.length <= st.crash_length:
                return None  # not yet past the point where it crashed
            self._strikes.pop(prob.seq_id, None)
            self._probation = None
        while self._parked:
            seq = self._parked.popleft()
            if seq.finished:  # aborted while held
                self._strikes.pop(seq.seq_id, None)
                continue
            self._probation = seq
            return seq
        return None

    def take_parked(self) -> list[Sequence]:
        """Every held request (to fail or abort them with the rest); their strikes are forgotten."""
        out = list(self._parked)
        self._parked.clear()
        for seq in out:
            self._strikes.pop(seq.seq_id, None)
        return out

    def parked(self) -> list[Sequence]:
        return list(self._parked)

    def strikes(self, seq_id: int) -> int:
        st = self._strikes.get(seq_id)
        return 0 if st is None else st.count
