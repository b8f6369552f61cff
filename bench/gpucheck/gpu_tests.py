"""Part ``tests``: ``python -m pytest -v -m gpu`` over each test file that holds ``gpu``-marked tests.

One pytest process per file, so a file's failures are reported (pytest prints them when its run ends)
before a slow file later on meets the time limit; each file's whole output is kept in the part's log
folder. The co-located switch tests go last: they are the slowest. ``--quick`` runs a few selections
only (``QUICK``): issue 30's tokens-unchanged tests (the fused layer kernels, the skinny GEMM), the gpu
tests of the kernels no GPU has run yet (the skinny GEMM's, the sampler's, the decode attention's fused
reduce), of graphs captured again without warm-ups and of graphs set aside and restored, the float32
co-located switch, which failed on the second H100 run with its message lost, and a
co-located TP2 group's collectives through the IPC slots (``--quick``'s decode part checks async
scheduling's tokens), and last, so that it delays none of those, the bits of a step with programmatic
dependent launch (``PAT_PDL``)."""

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

from common import markdown_table

from gpucheck import registry
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
    results = re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", verbose_output, re.MULTILINE)
    counts = Counter(outcome.lower() for _, outcome in results)
    started = re.findall(r"^(\S+::\S+)", verbose_output, re.MULTILINE)
    done = ", ".join(f"{n} {k}" for k, n in counts.items()) or "none finished"
    return done + (f"; last started: {started[-1]}" if started else "")


QUICK = (("tests/test_triton_layer_kernels.py", "fused_unfused_graphs or skinny"),  # (file, pytest -k): ~150 s
         ("tests/test_skinny_matmul.py", None), ("tests/test_triton_sampler.py", None),  # not run on a GPU yet
         ("tests/test_triton_kernel.py", None),  # the decode kernel's fused reduce: not run on a GPU yet
         ("tests/test_invariant_numerics.py", "row_alones"),  # the invariant mode's draws through them: not run yet
         # a capture without warm-ups, graphs set aside and restored: not run on a GPU yet
         ("tests/test_graph_capture_e2e.py", "without_warm_ups or set_aside"),
         # 2 ranks, both KV paths; a TP2 group's collectives through the IPC slots: not run on a GPU yet
         ("tests/test_colocated_gpu.py", "tp1xdp2_to_tp2_and_back_mid_batch_float32"),
         ("tests/test_triton_layer_kernels.py", "pdl"))  # PAT_PDL's bits (the newest: last, so it delays no other)


def gpu_test_files(tests_dir: Path) -> list[Path]:
    """Test files that hold a ``gpu``-marked test (collecting the others would import the serving extras)."""
    return sorted(p for p in tests_dir.glob("test_*.py") if "pytest.mark.gpu" in p.read_text())


def run_file(path: str, timeout: float, log_path: Path, keyword: str | None = None) -> tuple[int | None, str, float]:
    """(exit code or None when stopped at ``timeout``, whole output, seconds) of one file's gpu tests
    (those matching ``keyword``, pytest's ``-k``, when given)."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider", "-p", "gpucheck.failures_at_once",
           path]
    cmd += ["-k", keyword] if keyword else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    t = time.perf_counter()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)  # its own group: a stop ends the test's workers too
        try:
            returncode = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = None
    return returncode, log_path.read_text(), time.perf_counter() - t


def run(ctx: Ctx) -> PartResult:
    if importlib.util.find_spec("pytest") is None:
        return PartResult("skipped: pytest is not installed on this machine; the gpu-marked tests did not run.")
    files = sorted((str(p.relative_to(ROOT)) for p in gpu_test_files(ROOT / "tests")),
                   key=lambda f: ("colocated" in f, f))
    selection: list[tuple[str, str | None]] = list(QUICK) if ctx.quick else [(f, None) for f in files]
    logs = Path(ctx.args.workdir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started, rows, failures = time.perf_counter(), [], []
    limit = ctx.args.tests_timeout  # --quick: inside the part's own timeout, so the table is written
    limit = min(limit, registry.part("tests").quick_timeout_s - 20) if ctx.quick else limit
    for f, keyword in selection:
        label = f if keyword is None else f"{f} -k {keyword}"
        left = limit - (time.perf_counter() - started)
        if left < 5:
            rows.append([f"`{label}`", "not run: --tests-timeout spent", 0])
            failures.append(f"{label}: not run")
            continue
        returncode, out, secs = run_file(f, left, logs / f"gpu_tests_{Path(f).stem}.log", keyword)
        if returncode is None:
            rows.append([f"`{label}`", f"stopped at the limit: {outcomes_so_far(out)}", round(secs)])
            failures.append(f"{label}: stopped")
        else:
            rows.append([f"`{label}`", pytest_summary(out), round(secs)])
            if returncode not in (0, 5):
                failures.append(f"{label}: exit {returncode}")
        if returncode not in (0, 5):
            failures.append(f"```\n{out.strip()[-3000:]}\n```")
    total = time.perf_counter() - started
    lines = [(f"`python -m pytest -v -m gpu FILE`, one process per file{f' (--quick: {len(QUICK)} selections)' if ctx.quick else ''} "
              f"({total:.0f} s in all, limit {limit:.0f} s; logs in {logs}):"), "",
             markdown_table(["file", "result", "seconds"], rows), "",
             ("Only the files that hold `gpu`-marked tests are collected: the full `tests/` would import the serving "
             "extras (fastapi, httpx, ray), which a bare GPU machine lacks, and fail collection.")]
    if ctx.smoke:
        lines.append("\nSmoke: no CUDA here, so every gpu test is skipped; this checks the command only.")
    if failures:
        raise PartFailed("\n".join(lines + [""] + failures))
    return PartResult("\n".join(lines), [f"gpu tests: every selection passed or skipped ({len(selection)}, {total:.0f} s)"])
