"""The environment the engine gives its CPU workers (EngineConfig.worker_env): OpenMP's wait policy and
glibc's huge pages for large buffers, each only where the user has not set it."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from pat_engine import config
from pat_engine.config import EngineConfig

HUGE = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


@pytest.fixture(autouse=True)
def no_user_setting(monkeypatch):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(config, "_cores", lambda: 2)


def test_threads_that_own_their_cores_keep_the_runtimes_spin():
    assert EngineConfig("m", tp=1, dp=1).worker_env() == HUGE  # 2 threads, 2 cores
    assert EngineConfig("m", tp=2, dp=1).worker_env() == HUGE  # 1 thread each


def test_oversubscribed_threads_sleep():
    assert EngineConfig("m", tp=1, dp=1, threads_per_worker=3).worker_env() == {"OMP_WAIT_POLICY": "PASSIVE", **HUGE}
    assert EngineConfig("m", tp=4, dp=1).worker_env() == {"OMP_WAIT_POLICY": "PASSIVE", **HUGE}  # 4 workers, 2 cores


@pytest.mark.parametrize("name,value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "0"),
                                        ("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")])
def test_the_users_setting_wins(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    env = EngineConfig("m", tp=4, dp=1).worker_env()
    assert name not in env and ("OMP_WAIT_POLICY" in env) != name.startswith(("OMP", "GOMP"))


def test_gpu_workers_get_nothing():
    assert EngineConfig("m", device="cuda").worker_env() == {}


PROBE = """
import resource, torch
for _ in range(2):
    torch.ones(16 << 20).sum()  # 64 MB: above glibc's largest mmap threshold, mapped on every call
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    torch.ones(16 << 20).sum()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_for(tunables: str) -> int:
    env = {"PATH": "/usr/bin:/bin", "GLIBC_TUNABLES": tunables}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, check=True, capture_output=True, text=True)
    return int(out.stdout)


@pytest.mark.slow  # processes
def test_large_buffers_fault_in_huge_pages():
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sys.platform.startswith("linux") or not thp.is_file() or "[never]" in thp.read_text():
        pytest.skip("needs Linux with transparent huge pages")
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's allocator only")
    small, huge = faults_for("glibc.malloc.hugetlb=0"), faults_for(HUGE["GLIBC_TUNABLES"])
    assert small > 3 * 16384 * 0.9  # three 64 MB buffers in 4 KiB pages
    assert huge < small / 10


KEEP_PROBE = """
import sys, torch
from pat_engine.worker.device_memory import release_cached

def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) * 1024

buffers = [torch.ones(4 << 20) for _ in range(16)]  # 16 MiB each: under the fixed 32 MiB mmap threshold
held = rss()
del buffers
freed = rss()
release_cached(sys.argv[1])
print(held, freed, rss())
"""


@pytest.mark.slow  # processes
def test_the_heap_keeps_freed_buffers_until_released():
    """Under tunables that keep freed buffers in the heap (bench/worker_malloc.py's ``kept``, which a user may
    set), a release of memory (a sleep) still hands them to the OS."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's allocator only")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"}
    run = lambda device: [int(v) for v in subprocess.run([sys.executable, "-c", KEEP_PROBE, device], env=env,
                                                         check=True, capture_output=True, text=True).stdout.split()]
    held, freed, trimmed = run("cpu")
    size = 16 * (16 << 20)
    assert freed > held - 0.2 * size  # kept
    assert trimmed < freed - 0.8 * size  # handed back
    assert run("meta")[2] > held - 0.2 * size  # another device's release leaves the CPU heap alone
