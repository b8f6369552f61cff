"""Part ``tests``: ``python -m pytest -q -m gpu`` over the test files that hold ``gpu``-marked tests."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
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


def outcomes_so_far(verbose_output: str) -> str:
    """What a ``pytest -v`` run that was stopped had reported: "5 passed, 1 failed; last started: <test>"."""
    results = re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", verbose_output, re.M)
    counts = Counter(outcome.lower() for _, outcome in results)
    started = re.findall(r"^(\S+::\S+)", verbose_output, re.M)
    done = ", ".join(f"{n} {k}" for k, n in counts.items()) or "none finished"
    return done + (f"; last started: {started[-1]}" if started else "")


def gpu_test_files(tests_dir: Path) -> list[Path]:
    """Test files that hold a ``gpu``-marked test (collecting the others would import the serving extras)."""
    return sorted(p for p in tests_dir.glob("test_*.py") if "pytest.mark.gpu" in p.read_text())


def run(ctx: Ctx) -> PartResult:
    if importlib.util.find_spec("pytest") is None:
        return PartResult("skipped: pytest is not installed on this machine; the gpu-marked tests did not run.")
    files = [str(p.relative_to(ROOT)) for p in gpu_test_files(ROOT / "tests")]
    cmd = [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider", *files]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    log_path = Path(ctx.args.workdir) / "logs" / "gpu_tests_pytest.log"  # kept whole, also when stopped
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)  # its own group: a stop ends the test's workers too
        try:
            returncode = proc.wait(timeout=ctx.args.tests_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = None
    secs = time.perf_counter() - t
    out = log_path.read_text()
    if returncode is None:
        raise PartFailed(f"`python -m pytest -v -m gpu {' '.join(files)}` stopped after {secs:.0f} s (--tests-timeout "
                         f"{ctx.args.tests_timeout:.0f}): **{outcomes_so_far(out)}**\n\n```\n{out.strip()[-3000:]}\n```")
    summary = pytest_summary(out)
    lines = [f"`python -m pytest -v -m gpu {' '.join(files)}` ({secs:.0f} s, exit {returncode}): "
             f"**{summary}**", "",
             "Only the files that hold `gpu`-marked tests are collected: the full `tests/` would import the serving "
             "extras (fastapi, httpx, ray), which a bare GPU machine lacks, and fail collection."]
    if ctx.smoke:
        lines.append("\nSmoke: no CUDA here, so every gpu test is skipped; this checks the command only.")
    if returncode not in (0, 5):
        lines += ["", "```", out.strip()[-3000:], "```"]
        raise PartFailed("\n".join(lines))
    return PartResult("\n".join(lines), [f"gpu tests: {summary}"])
