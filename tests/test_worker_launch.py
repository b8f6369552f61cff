"""CPU workers forked from a warm fork server (core/worker_launch.py, worker/fork_server.py) start as
fresh processes would: the driver's environment, working directory and standard streams at the time of
the start, their exit codes, their deaths noticed, nothing left behind when the driver goes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import MAX_NEW, PROMPTS, hf_greedy_batch
from pat_engine import Engine, SamplingParams, WorkerFailure
from pat_engine.core import worker_launch
from pat_engine.worker.worker import Worker

pytestmark = pytest.mark.slow  # starts worker processes

GREEDY = [SamplingParams(max_new_tokens=m) for m in MAX_NEW]
PROBE = "test_worker_launch:ProbeWorker"  # EngineConfig.worker_class


class ProbeWorker(Worker):
    """Writes what its process was started with where ``PAT_TEST_PROBE`` says, and a line on stderr."""

    def __init__(self, args):
        super().__init__(args)
        with open(f"{os.environ['PAT_TEST_PROBE']}.{args.rank}", "w") as f:
            json.dump({"volatile": os.environ.get(VOLATILE), "cwd": os.getcwd(), "ppid": os.getppid()}, f)
        print(f"probe rank {args.rank} says hello", file=sys.stderr, flush=True)


VOLATILE = "TORCHINDUCTOR_CACHE_DIR"  # not part of a server's identity (protocol/startup.py FORK_VOLATILE_ENV)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_forked_workers_generate_exactly_and_a_later_engine_reuses_the_server(model_dir):
    path = model_dir("llama")
    with Engine(path, tp=2, dp=1, dtype="float64") as engine:
        servers = {_parent(pid) for pid in engine.worker_pids()}
        outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy_batch(path)
    (server,) = servers
    assert server != os.getpid() and _parent(server) == os.getpid()  # a fork server, child of this driver
    assert len(os.listdir(f"/proc/{server}/task")) == 1  # single-threaded: a fork copies no other thread's locks
    with Engine(path, tp=2, dp=1, dtype="float64") as again:
        assert {_parent(pid) for pid in again.worker_pids()} == {server}
    with Engine(path, tp=2, dp=1, dtype="float64", worker_launch="fresh") as fresh:
        assert {_parent(pid) for pid in fresh.worker_pids()} == {os.getpid()}


def test_a_forked_worker_gets_the_drivers_environment_directory_and_stderr_of_now(model_dir, tmp_path,
                                                                                  monkeypatch, capfd):
    """The server is started first, outside this test's capture; then the driver changes directory and a
    variable that does not pick the server: the worker forked next has them, and writes to the capture."""
    path = model_dir("llama")
    monkeypatch.setenv("PAT_TEST_PROBE", str(tmp_path / "probe"))
    monkeypatch.setenv(VOLATILE, "before")
    with capfd.disabled(), Engine(path, tp=2, dp=1, dtype="float64") as engine:
        servers = {_parent(pid) for pid in engine.worker_pids()}
    monkeypatch.setenv(VOLATILE, "set after the server started")
    monkeypatch.chdir(tmp_path)
    with Engine(path, tp=2, dp=1, dtype="float64", worker_class=PROBE) as engine:
        pids = engine.worker_pids()
        assert {_parent(pid) for pid in pids} == servers  # the same server, started before the changes
    for rank in range(2):
        seen = json.loads((tmp_path / f"probe.{rank}").read_text())
        assert seen["volatile"] == "set after the server started" and seen["cwd"] == str(tmp_path)
    err = capfd.readouterr().err
    assert "probe rank 0 says hello" in err and "probe rank 1 says hello" in err
    assert not any(map(_running, pids))


def test_a_killed_forked_worker_is_reported_with_its_signal(model_dir):
    """A forked worker is no child of the driver, yet its death is reported with the signal that ended it.
    Who meets the death first is a race: the next step (its requests then fail with the report), or, the
    engine idle, the loop's watch of its workers (it restarts them, and the next call runs; the full suite
    met this order once on a loaded host). Either way the engine's last failure says it."""
    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float64", recover_failed_workers=False) as engine:
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2), use_tqdm=False)
        victim = engine.worker_pids()[1]
        os.kill(victim, signal.SIGKILL)
        report = f"rank 1 (pid {victim}) died: exit code -9"
        try:
            engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=40), use_tqdm=False)
        except WorkerFailure as exc:
            assert report in str(exc)
        deadline = time.monotonic() + 30
        while report not in (engine.health()["last_failure"] or "") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert report in (engine.health()["last_failure"] or "")


def test_a_dead_fork_server_is_replaced(model_dir):
    path = model_dir("llama")
    with Engine(path, tp=1, dp=1, dtype="float64") as engine:
        (server,) = {_parent(pid) for pid in engine.worker_pids()}
    os.kill(server, signal.SIGKILL)
    with Engine(path, tp=1, dp=1, dtype="float64") as engine:
        (now,) = {_parent(pid) for pid in engine.worker_pids()}
        out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4), use_tqdm=False)[0]
    assert now not in (server, os.getpid()) and len(out.token_ids) == 4


DRIVER_DIES = """
import os, sys
from pat_engine import Engine
engine = Engine(sys.argv[1], tp=1, dp=2, dtype="float64")
print(*engine.worker_pids(), flush=True)
os._exit(0)  # no shutdown, no exit hook: as a driver killed outright
"""


def test_workers_and_server_go_when_the_driver_dies_without_a_word(model_dir, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER_DIES)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, str(script), model_dir("llama")], env=env, capture_output=True,
                         text=True, timeout=120)
    workers = [int(p) for p in out.stdout.split()]
    assert len(workers) == 2, out.stderr
    server = _parent(workers[0]) if _running(workers[0]) else None
    deadline = time.monotonic() + 10
    while any(map(_running, workers + ([server] if server else []))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_running, workers)), "workers outlived their driver"
    assert server is None or not _running(server), "the fork server outlived its driver"


def test_the_launch_mode_is_checked():
    from pat_engine.config import EngineConfig
    from pat_engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="worker_launch must be one of auto, fresh"):
        EngineConfig("m", worker_launch="spawn")
    assert worker_launch.uses_fork_server("auto", "cpu")
    assert not worker_launch.uses_fork_server("auto", "cuda") and not worker_launch.uses_fork_server("fresh", "cpu")
