"""lm-eval's ``local-completions`` runs a generate_until and a loglikelihood task against pat-serve.

Needs lm-eval in this interpreter or at ``$PAT_LM_EVAL_PYTHON`` (bench/lm_eval_smoke.py can make a
venv for it); skipped otherwise, saying so.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts worker processes and lm-eval

ROOT = Path(__file__).resolve().parents[1]


def test_lm_eval_generate_until_and_multiple_choice_complete(tmp_path):
    if importlib.util.find_spec("lm_eval") is None and not os.environ.get("PAT_LM_EVAL_PYTHON"):
        pytest.skip('lm-eval is not installed here (pip install "lm-eval[api]", or set PAT_LM_EVAL_PYTHON)')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "profiler"), str(ROOT / "bench")])}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "lm_eval_smoke.py"), "--no-install"],
                          capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| pat_gen_until | exact_match" in proc.stdout and "| pat_mc | acc" in proc.stdout, proc.stdout
