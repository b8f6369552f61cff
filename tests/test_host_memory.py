"""CPU workers keep a step's large buffers mapped (worker/host_memory.py): a freed 64 MB buffer's pages
serve the next one without faulting, and ``give_back`` still returns them to the OS."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pat_engine.worker import host_memory

PROBE = """
import resource, sys, torch
from pat_engine.worker import host_memory
kept = host_memory.keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def rss_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
torch.ones(16 << 20).sum()  # 64 MB, the first time: faulted in
before = faults()
torch.ones(16 << 20).sum()  # the same size again: a fresh mapping, or the freed pages
again = faults() - before
held = rss_kib()
host_memory.give_back()
print(kept, again, held - rss_kib())
"""


def probe(heap: str) -> tuple[bool, int, int]:
    env = {"PAT_HOST_HEAP": heap, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, check=True, capture_output=True, text=True,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    kept, again, returned = out.stdout.split()
    return kept == "True", int(again), int(returned)


@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc's allocator only")
def test_freed_buffers_are_reused_and_given_back_on_purpose():
    kept, again, returned = probe("keep")
    assert kept
    assert again < 1000  # 64 MB is 16,384 pages: reused, not faulted in again
    assert returned > 50_000  # KiB: give_back returned the freed 64 MB
    kept, again, _ = probe("trim")  # glibc's defaults: mapped afresh, every page faulted again
    assert not kept and again > 10_000
