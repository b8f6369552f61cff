"""A pytest plugin: print each failure's report when it happens, not in the summary at the session's end.

The gpu tests run under a time limit (the device lends 15 minutes a session); a run stopped at its limit
never reaches pytest's summary, and the second H100 run lost both float32 co-located failures' messages
that way. Loaded with ``-p gpucheck.failures_at_once`` (gpu_tests.run_file)."""

from __future__ import annotations

import pytest

KEPT_CHARS = 6000  # the end of a long traceback: the assertion and the frames nearest it


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        print(f"\n---- failed: {report.nodeid} ({report.when}) ----\n{report.longreprtext[-KEPT_CHARS:]}\n", flush=True)
