"""Shared helpers for benchmarks: machine description and result files."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from pat_engine.platform_info import machine_summary
from pat_engine.tiny_model import TinyModelSpec

RESULTS = Path(__file__).resolve().parent / "results"

# Issue 11's checkpoint, the one the CPU hot-path benchmarks share (peer_cpu, step_breakdown, the
# per-piece benches): Llama, 4 layers, hidden 512, 8 heads / 4 KV heads, intermediate 1536.
PEER_SPEC = TinyModelSpec(arch="llama", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=4,
                          num_heads=8, num_kv_heads=4, max_position=2048, seed=11)


def machine() -> str:
    return machine_summary()


def rss_bytes(pid: int) -> int:
    """A process's resident memory (``VmRSS``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def fmt(v) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|")  # a bare pipe would start another column

    lines = ["| " + " | ".join(fmt(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def worker_process_env() -> dict[str, str]:
    """The environment variables an engine gives a 2-thread CPU worker (``EngineConfig.worker_env``)."""
    from pat_engine.config import EngineConfig

    return EngineConfig(model="unused", threads_per_worker=2).worker_env()


def json_from_worker_process(code: str, checkout: Path, what: str) -> object:
    """Run ``code`` (Python whose last printed line is JSON) in a fresh process on ``checkout``'s sources, with
    ``worker_process_env``: that JSON. A failed run ends the benchmark with its error."""
    paths = [checkout / p for p in ("", "csrc", "profiler", "integrations", "bench")]
    env = dict(os.environ, **worker_process_env(), PYTHONPATH=os.pathsep.join(map(str, paths)))
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=checkout, capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        sys.exit(f"{what} failed in {checkout}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_result(name: str, title: str, body: str) -> Path:
    """Print ``body`` and write it to bench/results/<name>.md with command, machine and date."""
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    text = (
        f"# {title}\n\n"
        f"- command: `{command}`\n"
        f"- machine: {machine()}\n"
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}\n\n"
        f"{body}\n"
    )
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text(text)
    return path


def settled_kv(url: str, headers: dict | None = None, timeout: float = 30.0) -> dict:
    """pat-serve's ``/pat/kv`` once nothing runs (or ``timeout`` passes): aborts of hung-up streams
    land within about half a second of the hang-up."""
    import httpx

    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        while True:
            kv = client.get("/pat/kv").json()
            if kv["unfinished"] == 0 or time.monotonic() > deadline:
                return kv
            time.sleep(0.2)


def tree_at(commit: str, paths: list[str]) -> Path:
    """``paths`` of the repository at ``commit`` (``git archive``) in a temporary folder: a baseline tree
    that a benchmark imports in its own process beside this one."""
    folder = Path(tempfile.mkdtemp(prefix=f"pat-{commit}-"))
    archive = subprocess.run(["git", "archive", commit, *paths], cwd=Path(__file__).resolve().parent.parent,
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def alternating_rounds(script: str, trees: dict[str, Path], rounds: int, args: list[str],
                       env_for: Callable[[str, Path], dict[str, str]] | None = None) -> dict[str, list[dict]]:
    """Run ``script --measure *args`` once per tree and round, the trees alternating (base, new, base, new,
    ...) on this noisy shared host; each run imports its tree (``PYTHONPATH``: the tree, its csrc/ where it has
    one, and bench/, or what ``env_for(label, tree)`` gives) and prints one JSON line last. Returns each
    tree's runs by label."""
    runs: dict[str, list[dict]] = {label: [] for label in trees}
    for _ in range(rounds):
        for label, tree in trees.items():
            kernels = [str(tree / "csrc")] if (tree / "csrc").is_dir() else []  # the workers import pat_kernels too
            env = {"PYTHONPATH": os.pathsep.join([str(tree), *kernels, str(Path(__file__).parent)])}
            env.update(env_for(label, tree) if env_for else {})
            done = subprocess.run([sys.executable, script, "--measure", *args], env={**os.environ, **env},
                                  check=True, capture_output=True, text=True)
            runs[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return runs


def tree_medians(runs: dict[str, list[dict]], key: str) -> tuple[float, float, bool]:
    """Of ``alternating_rounds``' runs whose rows are ``[seconds, digest]``: the median seconds of row ``key``
    in the base and the new tree, and whether every round of both gave the same digest."""
    base, new = (statistics.median(r[key][0] for r in runs[label]) for label in ("base", "new"))
    return base, new, len({r[key][1] for label in runs for r in runs[label]}) == 1


def tree_comparison_args(doc: str, steps: int, steps_help: str, base: str) -> argparse.Namespace:
    """The options of a benchmark that times this tree against commit ``--base`` with ``alternating_rounds``:
    ``--rounds``, ``--steps``, ``--base``, and the hidden ``--measure`` (one round, JSON on stdout)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=steps, help=steps_help)
    p.add_argument("--base", default=base, help="the commit that is the baseline")
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def worker_processes(pid: int) -> list[int]:
    """The worker processes of the engine in process ``pid`` (a pat-serve, say), from /proc: its children
    running ``pat_engine.worker``, or on the CPU the children of its fork server (core/worker_launch.py),
    never the fork server itself."""
    out = []
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:  # gone meanwhile
            continue
        if b"pat_engine.worker.fork_server" in cmd:
            out += _children(child)
        elif b"pat_engine.worker" in cmd:
            out.append(child)
    return sorted(out)
