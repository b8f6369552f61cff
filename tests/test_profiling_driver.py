"""The driver's side of a profile (core/profiling.py) against a stand-in for the workers: one session at a time,
and a start that a rank refuses leaves no rank recording."""

from __future__ import annotations

import pytest

from pat_engine.core.profiling import Profiling
from pat_engine.errors import InvalidRequestError, WorkerFailure
from pat_engine.protocol.calls import StartProfile, StopProfile


class Ranks:
    """Two ranks' profile states; ``refuse`` makes rank 1 fail a start (rank 0 has started by then)."""

    def __init__(self, refuse: bool = False):
        self.recording, self.refuse, self.asked = [False, False], refuse, []

    def ask(self, call):
        self.asked.append(type(call).__name__)
        if isinstance(call, StartProfile):
            self.recording[0] = True
            if self.refuse:
                raise WorkerFailure("StartProfile failed on rank 1: no room for the trace", rank=1)
            self.recording[1] = True
            return None
        assert isinstance(call, StopProfile)
        stopped, self.recording = [r for r, on in enumerate(self.recording) if on], [False, False]
        if len(stopped) < 2:
            raise WorkerFailure("StopProfile failed on rank 1: no profile to stop", rank=1)
        return [[f"rank{r}.pt.trace.json.gz", f"rank{r}.table.txt"] for r in stopped]


def test_a_refused_start_stops_the_ranks_that_started(tmp_path):
    ranks = Ranks(refuse=True)
    profiling = Profiling(ranks.ask)
    with pytest.raises(WorkerFailure, match="no room"):
        profiling.start(str(tmp_path), None, False, False)
    assert ranks.asked == ["StartProfile", "StopProfile"] and ranks.recording == [False, False]
    assert profiling.running is None
    ranks.refuse = False
    profiling.start(str(tmp_path), 5, False, False)  # the next start finds no rank recording
    assert profiling.stop() == ["rank0.pt.trace.json.gz", "rank0.table.txt", "rank1.pt.trace.json.gz",
                                "rank1.table.txt"]


def test_one_session_at_a_time_with_distinct_names(tmp_path):
    ranks = Ranks()
    profiling = Profiling(ranks.ask)
    profiling.start(str(tmp_path), None, False, False)
    first = profiling.running
    with pytest.raises(InvalidRequestError, match="already running"):
        profiling.start(str(tmp_path), None, False, False)
    profiling.stop()
    with pytest.raises(InvalidRequestError, match="no profile is running"):
        profiling.stop()
    profiling.start(str(tmp_path), None, False, False)
    assert profiling.running.name != first.name and profiling.running.output_dir == str(tmp_path)
