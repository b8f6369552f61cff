"""Per-prompt response-length history: the prediction the long-round layout uses.

Prompts that produced long responses keep doing so across steps (RollPacker, SAGC), so a
prompt's own past lengths predict its next ones; a partial output that was cut short is a
lower bound. Unknown prompts get the mean over all prompts, or ``default`` before any.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence


class LengthHistory:
    def __init__(self, default: float, window: int = 32):
        self.default = float(default)
        self.window = window
        self._seen: dict[int, list[int]] = defaultdict(list)
        self._floor: dict[int, int] = {}
        self._sum, self._n = 0.0, 0

    def record(self, uid: int, lengths: Sequence[int]) -> None:
        """Lengths of finished responses of prompt ``uid``."""
        seen = self._seen[uid]
        seen.extend(int(x) for x in lengths)
        del seen[: -self.window]
        self._sum += float(sum(lengths))
        self._n += len(lengths)

    def record_partial(self, uid: int, generated: int) -> None:
        """A response of ``uid`` was cut after ``generated`` tokens: it is at least that long."""
        self._floor[uid] = max(self._floor.get(uid, 0), int(generated))

    def predict(self, uid: int) -> float:
        seen = self._seen.get(uid)
        base = sum(seen) / len(seen) if seen else (self._sum / self._n if self._n else self.default)
        return max(base, float(self._floor.get(uid, 0)))
