"""Running the real ``pat-serve`` command in a subprocess, from a checkout or an installed wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cli_env() -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def cli_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pat_engine.serve", *map(str, args)]


def run_cli(*args: str, timeout: float = 180, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cli_cmd(*args), env=cli_env(), cwd=cwd, capture_output=True, text=True, timeout=timeout)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path
