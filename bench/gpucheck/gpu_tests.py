"""Part ``tests``: ``python -m pytest -q -m gpu`` over the test files that hold ``gpu``-marked tests."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from gpucheck.report import PartResult
from gpucheck.shared import Ctx, PartFailed

ROOT = Path(__file__).resolve().parents[2]


def pytest_summary(output: str) -> str:
    """pytest -q's last summary line ("3 passed, 1 skipped in 4.2s"), or the last line of the output."""
    lines = [ln.strip().strip("=").strip() for ln in output.strip().splitlines() if ln.strip()]
    pattern = re.compile(r"\b\d+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b|no tests ran")
    for line in reversed(lines):
        if pattern.search(line):
            return line
    return lines[-1] if lines else "(no output)"


def gpu_test_files(tests_dir: Path) -> list[Path]:
    """Test files that hold a ``gpu``-marked test (collecting the others would import the serving extras)."""
    return sorted(p for p in tests_dir.glob("test_*.py") if "pytest.mark.gpu" in p.read_text())


def run(ctx: Ctx) -> PartResult:
    if importlib.util.find_spec("pytest") is None:
        return PartResult("skipped: pytest is not installed on this machine; the gpu-marked tests did not run.")
    files = [str(p.relative_to(ROOT)) for p in gpu_test_files(ROOT / "tests")]
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ctx.args.tests_timeout, env=env, cwd=ROOT)
    secs = time.perf_counter() - t
    out = proc.stdout + proc.stderr
    summary = pytest_summary(out)
    lines = [f"`python -m pytest -q -m gpu {' '.join(files)}` ({secs:.0f} s, exit {proc.returncode}): "
             f"**{summary}**", "",
             "Only the files that hold `gpu`-marked tests are collected: the full `tests/` would import the serving "
             "extras (fastapi, httpx, ray), which a bare GPU machine lacks, and fail collection."]
    if ctx.smoke:
        lines.append("\nSmoke: no CUDA here, so every gpu test is skipped; this checks the command only.")
    if proc.returncode not in (0, 5):
        lines += ["", "```", out.strip()[-3000:], "```"]
        raise PartFailed("\n".join(lines))
    return PartResult("\n".join(lines), [f"gpu tests: {summary}"])
