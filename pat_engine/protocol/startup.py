"""What the driver hands a worker process when it starts."""

from __future__ import annotations

from dataclasses import dataclass

from pat_engine.config import EngineConfig
from pat_engine.parallel.devices import DevicePlacement
from pat_engine.parallel.layout import Layout


@dataclass(frozen=True)
class WorkerArgs:
    rank: int
    world: int
    store_host: str
    store_port: int
    config: EngineConfig
    layout: Layout
    num_blocks: int  # KV blocks of the first pool (0: the driver allocates it later with ``allocate_kv``)
    parent_pid: int
    weights_path: str  # where to load weights from (the model dir, or a later update_weights_from_disk)
    placement: DevicePlacement  # which device each rank runs on, and whether ranks share one
