"""Shared fixtures: tiny random checkpoints and a cached transformers reference."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pat_engine.core.loop_thread import LOOP_THREAD_NAME
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():  # Triton kernels run in numpy on the CPU; read when Triton loads, so first
    os.environ.setdefault("TRITON_INTERPRET", "1")

ALL_SLOW = re.compile(r"^pytestmark = pytest\.mark\.slow\b", re.M)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The fast tier (``-m "not slow"``) does not import a test module whose every test is slow: it would
    only deselect them, and some import heavy frameworks to do so (veRL's adapter tests: 4 s)."""
    if config.option.markexpr.strip() != "not slow" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_") or not ALL_SLOW.search(collection_path.read_text()):
        return None
    return True


# Ragged prompts and lengths; some requests generate 48+ tokens.
PROMPTS = [
    [5, 6, 7],
    [100, 20, 30, 40, 50, 60, 70],
    [9],
    [33, 44, 55, 66, 77, 88, 99, 111, 222, 333, 3, 4, 17, 18, 19, 20, 21],
    [250, 251],
    [300, 12, 13, 14, 15],
]
MAX_NEW = [48, 20, 56, 30, 12, 40]

SPECS = {
    "llama": TinyModelSpec(arch="llama", num_kv_heads=2),  # GQA; tp=4 > 2 KV heads replicates them
    "qwen2": TinyModelSpec(arch="qwen2", num_kv_heads=4, tie_word_embeddings=True, seed=1),
    "qwen3": TinyModelSpec(arch="qwen3", num_kv_heads=2, seed=2),
    "llama31": TinyModelSpec(arch="llama", num_kv_heads=8, llama3_rope_scaling=True, seed=3),
    # routed experts; layer 1 keeps a dense MLP (mlp_only_layers)
    "qwen3_moe": TinyModelSpec(arch="qwen3_moe", num_layers=3, num_kv_heads=2, mlp_only_layers=(1,), seed=4),
}


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int, failures=None) -> Iterator[None]:
    """A spawned test rank inside its process group (gloo on loopback, one torch thread): an exception goes
    to ``failures`` (``mp.spawn`` only says which rank failed), and the group ends either way."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    except BaseException as e:
        if failures is not None:
            failures.put(f"rank {rank}: {e!r}")
        raise
    finally:
        dist.destroy_process_group()


def shared_memory_files(pids: list[int], since: float) -> list[str]:
    """The shared-memory files torch made for these processes (``file_system`` names them torch_<pid>_...)
    that are not older than ``since`` (time.time()): a file an earlier process of a reused pid left is not
    theirs."""
    return [str(f) for pid in pids for f in Path("/dev/shm").glob(f"torch_{pid}_*")
            if _mtime(f) >= since - 1.0]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # unlinked meanwhile
        return float("-inf")


def wait_for_no_shared_memory_files(pids: list[int], since: float, seconds: float = 10.0) -> list[str]:
    """Wait until torch's shm manager unlinked these processes' files (it does once their last user let go);
    what is still there after ``seconds``."""
    deadline = time.monotonic() + seconds
    while (left := shared_memory_files(pids, since)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _engine_loops() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == LOOP_THREAD_NAME and t.is_alive()}


@pytest.fixture(scope="module", autouse=True)
def no_engine_left_running():
    """Every engine a test module starts is shut down by the end of the module. A leaked engine keeps its
    loop thread polling until the interpreter exits, where it can crash the teardown (a CI run that had
    leaked 17 ended in a segfault after every test had passed)."""
    before = _engine_loops()
    yield
    deadline = time.monotonic() + 10.0
    while (left := _engine_loops() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        pytest.fail(f"{len(left)} engine(s) started in this module are still running: shut them down "
                    "(``with Engine(...)`` or ``engine.shutdown()``)", pytrace=False)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """``model_dir(name)`` -> path of a tiny checkpoint written once per session."""
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = str(write_tiny_model(tmp_path_factory.mktemp(name), SPECS[name]))
        return cache[name]

    return get


_HF_CACHE: dict[tuple, list[int]] = {}


def hf_greedy(path: str, prompt: list[int], max_new: int) -> list[int]:
    """Greedy continuation by ``transformers`` in float64 (the reference)."""
    key = (path, tuple(prompt), max_new)
    if key not in _HF_CACHE:
        model = _hf_model(path)
        ids = torch.tensor([prompt])
        # every token is attended: without a mask, generate would mask out the pad id (0) inside a prompt
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
        _HF_CACHE[key] = out[0, len(prompt):].tolist()
    return _HF_CACHE[key]


_HF_MODELS: dict[str, object] = {}


def _hf_model(path: str):
    if path not in _HF_MODELS:
        from transformers import AutoModelForCausalLM

        # the experts' loop (transformers' default, grouped_mm, has no float64 kernel on the CPU)
        moe = {"experts_implementation": "eager"} if "moe_intermediate_size" in Path(path, "config.json").read_text() else {}
        _HF_MODELS[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **moe).eval()
    return _HF_MODELS[path]


def hf_greedy_batch(path: str, prompts=PROMPTS, max_new=MAX_NEW) -> list[list[int]]:
    return [hf_greedy(path, p, m) for p, m in zip(prompts, max_new)]
