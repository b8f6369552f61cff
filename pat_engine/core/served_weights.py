"""ServedWeights: which weights the workers serve, and whether a restart can bring them back.

The one owner of that state. The engine's RL methods (update, wake-up after a
sleep that discarded them) and the engine loop's restart path report what
happened; generation asks ``refusal()`` whether it may start. What memory is
released is ``SleepState``'s record, not this one's.
"""

from __future__ import annotations

from dataclasses import dataclass

INITIAL_WEIGHT_VERSION = "default"  # SGLang's name for the weights a server started with


@dataclass
class ServedWeights:
    path: str  # the checkpoint workers load at start and after a restart
    on_disk: bool = True  # False after in-memory updates: a restart would lose them
    stale: bool = False  # the workers do not serve the latest weights (until the trainer pushes them again)
    updates: int = 0  # weight updates applied so far (every kind: tensors, disk, distributed)
    version: str = INITIAL_WEIGHT_VERSION  # what responses report; the caller's string, else the update count

    def new_version(self, version: str | None = None) -> str:
        """One whole weight update finished: count it and name the version now served."""
        self.updates += 1
        self.version = str(version) if version is not None else str(self.updates)
        return self.version

    def updated_in_memory(self) -> None:
        self.on_disk, self.stale = False, False

    def update_failed(self) -> None:
        """An update stopped part-way (some ranks or buckets applied): no layout serves a whole model."""
        self.on_disk, self.stale = False, True

    def updated_from_disk(self, path: str) -> None:
        self.path, self.on_disk, self.stale = path, True, False

    def workers_restarted(self) -> None:
        """Fresh workers loaded ``path``: after in-memory updates those are not the latest weights."""
        if not self.on_disk:
            self.stale = True

    def restored_after_discard(self) -> bool:
        """Weights a sleep discarded come back: True when they are to be reloaded from ``path``. After
        in-memory updates nothing on disk holds them: they are stale until the trainer pushes them."""
        if not self.on_disk:
            self.stale = True
        return self.on_disk

    def refusal(self) -> str | None:
        """Why new requests cannot run now (the served weights are not the latest), or None."""
        if self.stale:
            return ("the served weights are not current (workers restarted after a failure, or woken from a "
                    "level-2 sleep, after in-memory weight updates); call update_weights() or "
                    "update_weights_from_disk() first")
        return None
