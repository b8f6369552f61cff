"""What the driver hands a worker process when it starts, and how it asks a fork server for one
(worker/fork_server.py, core/worker_launch.py)."""

from __future__ import annotations

import struct
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
    parent_pid: int  # its parent (the driver, or the fork server that forked it): the worker exits when it does
    weights_path: str  # where to load weights from (the model dir, or a later update_weights_from_disk)
    placement: DevicePlacement  # which device each rank runs on, and whether ranks share one


FORK_STATUS = struct.Struct("i")  # a forked worker's exit code, as the fork server writes it into its status pipe
FORK_MAX_MESSAGE = 1 << 20  # a launch request's pickled bytes (an environment of a few KiB)
# differ between launches and are read by nothing at import time: not part of a fork server's identity
# (pytest names the running test; torch sets its compile cache's folder the first time it is asked for it)
FORK_VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})


@dataclass(frozen=True)
class LaunchRequest:
    """One worker for a fork server to fork: the environment and working directory it gets, and which of the
    request's file descriptors is which (``fds[i]`` is named ``names[i]``: "conn", the worker's end of its
    driver socket; "status", the write end of its exit-status pipe; "0", "1", "2", the driver's standard
    streams that are open)."""

    env: dict[str, str]
    cwd: str
    names: tuple[str, ...]
