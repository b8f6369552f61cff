"""The OpenMP wait policy the engine gives its CPU workers (EngineConfig.worker_env)."""

from __future__ import annotations

import pytest

from pat_engine import config
from pat_engine.config import EngineConfig


@pytest.fixture(autouse=True)
def no_user_policy(monkeypatch):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(config, "_cores", lambda: 2)


def test_threads_that_own_their_cores_keep_the_runtimes_spin():
    assert EngineConfig("m", tp=1, dp=1).worker_env() == {}  # 2 threads, 2 cores
    assert EngineConfig("m", tp=2, dp=1).worker_env() == {}  # 1 thread each


def test_oversubscribed_threads_sleep():
    assert EngineConfig("m", tp=1, dp=1, threads_per_worker=3).worker_env() == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert EngineConfig("m", tp=4, dp=1).worker_env() == {"OMP_WAIT_POLICY": "PASSIVE"}  # 4 workers, 2 cores


@pytest.mark.parametrize("name,value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "0")])
def test_the_users_setting_wins(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert EngineConfig("m", tp=1, dp=1).worker_env() == {}


def test_gpu_workers_get_nothing():
    assert EngineConfig("m", device="cuda").worker_env() == {}
