"""The profile table's decode-step fit, corrected by the engine's own steps.

A table is measured once, with dummy batches, every DP group at the same batch, on the machine as it was
that day. The engine's steps then differ from it: the machine is busier or slower now, ranks sharing a GPU
slow each other where the table's groups ran in step, a batch size the table only interpolates. How much
depends on the TP degree and the batch size (bench/results/predictor_accuracy.md, its table by batch size),
so the correction is kept per TP degree and batch size: the median of ``measured / fitted`` over that key's
last ``window`` steps, a short window, since a key's ratio drifts as its requests' contexts grow and the
host's load changes (bench/results/calibration_window.md). A key with fewer than
``min_steps`` steps takes its TP degree's nearest batch size that has them; a TP degree that has not run
takes, batch size by batch size, the one that ran last (the same machine, the same batch: the best guess
there is, and one that prices a switch as the table does until the target has run).

``factor(tp, batch)`` multiplies the fit. Nothing seen: 1, the table as profiled. What it cannot do is
correct a layout that has not run: one whose table is too pessimistic is never switched to, so never seen.
The engine records plain decode steps only (a prefill, or a speculating step, has its own price), in a
backlog taken in when a price is next asked: recording is an append on the step loop.
``bench/predictor_accuracy.py`` (CPU) and ``bench/gpu_check.py --only controller`` (a GPU) measure the
predictor with and without it on the same steps; ``bench/simulate_calibration.py`` its effect on choices.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class CalibrationConfig:
    window: int = 8  # steps kept per (TP degree, batch size): how fast a change is followed
    min_steps: int = 3  # of a key, before its own ratio replaces its nearest neighbour's (3: a median outvotes a stall)
    max_ratio: float = 4.0  # one step's measured / fitted is clipped to [1/r, r] (a stall, a page-in)
    # steps are taken in when a price is asked (every controller check), or once this many wait
    backlog: int = 256


Fit = Callable[[int, float, float], float]  # the table's step seconds: f(tp, batch, total context)


class StepCalibration:
    def __init__(self, fit: Fit, config: CalibrationConfig = CalibrationConfig()):
        self.fit = fit
        self.config = config
        self._backlog: list[tuple[int, int, float, float]] = []
        self._steps: dict[tuple[int, int], deque[float]] = {}  # (tp, batch) -> log(measured / fitted)
        self._last_tp: int | None = None
        self._taken = 0
        self._tables: dict[int, np.ndarray] = {}  # tp -> log factor by batch size (index), rebuilt lazily

    @property
    def steps(self) -> int:
        """Steps taken in so far."""
        self._catch_up()
        return self._taken

    def record(self, tp: int, batch: int, context_tokens: float, seconds: float) -> None:
        """A plain decode step of ``batch`` requests holding ``context_tokens`` under TP ``tp`` took ``seconds``."""
        if seconds > 0 and batch > 0:
            self._backlog.append((tp, batch, context_tokens, seconds))
            if len(self._backlog) >= self.config.backlog:
                self._catch_up()

    def factor(self, tp: int, batch):
        """Measured / fitted to expect of a step of ``batch`` requests under TP ``tp`` (a float or an array)."""
        self._catch_up()
        table = self._table(tp)
        if table is None:
            return 1.0 if np.ndim(batch) == 0 else np.ones(np.shape(batch))
        index = np.clip(np.rint(batch).astype(np.int64), 0, len(table) - 1)
        out = np.exp(table[index])
        return float(out) if np.ndim(batch) == 0 else out

    def typical(self, tp: int) -> float:
        """The median factor over the batch sizes TP ``tp`` (or, unseen, the last TP degree run) has run at."""
        self._catch_up()
        src = tp if any(t == tp for t, _ in self._steps) else self._last_tp
        ratios = [_median(s) for (t, _), s in self._steps.items() if t == src]
        return math.exp(_median(ratios)) if ratios else 1.0

    def _catch_up(self) -> None:
        if not self._backlog:
            return
        backlog, self._backlog = self._backlog, []
        limit = math.log(self.config.max_ratio)
        for tp, batch, context_tokens, seconds in backlog:
            fitted = self.fit(tp, batch, context_tokens)
            if fitted <= 0:
                continue
            ratio = min(max(math.log(seconds / fitted), -limit), limit)
            self._steps.setdefault((tp, batch), deque(maxlen=self.config.window)).append(ratio)
            self._last_tp = tp
            self._taken += 1
        self._tables.clear()

    def _table(self, tp: int) -> np.ndarray | None:
        """Log factor of every batch size 0..(largest seen + 1) for ``tp`` (an unseen TP: the last one run's);
        beyond the end, the last entry. None before any step."""
        if tp in self._tables:
            return self._tables[tp]
        own = {b: _median(s) for (t, b), s in self._steps.items() if t == tp and len(s) >= self.config.min_steps}
        if not own and self._last_tp is not None and self._last_tp != tp:
            table = self._table(self._last_tp)
        elif not own:
            table = None
        else:
            sizes = sorted(own)
            top = max(b for _, b in self._steps)
            table = np.array([own[_nearest(sizes, b)] for b in range(top + 2)])
        self._tables[tp] = table
        return table


def _nearest(sizes: list[int], b: int) -> int:
    """The element of sorted ``sizes`` nearest ``b`` (the smaller on a tie)."""
    i = bisect_left(sizes, b)
    if i == 0:
        return sizes[0]
    if i == len(sizes):
        return sizes[-1]
    return sizes[i - 1] if b - sizes[i - 1] <= sizes[i] - b else sizes[i]


def _median(values) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
