"""The reward stage: each response scored as soon as it finishes, while the rest still generate.

A reward is a plain callable ``fn(output) -> float``, an ``async def`` one, or a
``SubprocessReward`` (a command that reads the response on stdin and prints its score, the way
code and math verifiers run). ``RewardStage`` runs them in a bounded pool of ``max_workers``
threads, concurrently with generation, and streams ``RewardResult``s as they complete. A
timeout or a crash becomes that response's recorded failure (``error``, reward None): never a
lost response, a hung step or a dead engine.

Timeouts follow RollPacker's adaptive rule per task (a test case, a prompt): with ``T_anchor``
the longest evaluation so far that succeeded (reward above ``success_above``), the limit is
``min(max(t_min, factor * T_anchor), t_max)``, and ``t_max`` until one has succeeded. Doomed
executions (an infinite loop, a slow wrong answer) fail fast once correct ones are known.

What can be stopped: a subprocess is killed with its whole process group at its limit; an async
reward is cancelled; a plain callable cannot be interrupted in Python, so at its limit it is
recorded as timed out and left to finish in a daemon thread that holds no pool slot (use a
subprocess for code that may never return).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pat_engine.outputs import RequestOutput


@dataclass(frozen=True)
class RewardConfig:
    max_workers: int = 4  # evaluations at once
    timeout_s: float | None = None  # a fixed limit; None: the adaptive rule below
    t_min: float = 2.0  # RollPacker's values
    t_max: float = 30.0
    factor: float = 1.5
    success_above: float = 0.0  # a reward above this anchors its task's timeout

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {self.max_workers}")
        if not 0 < self.t_min <= self.t_max:
            raise ValueError(f"need 0 < t_min <= t_max, got {self.t_min} and {self.t_max}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")


class AdaptiveTimeout:
    """Per task: the longest successful evaluation so far, and the limit it implies (thread-safe)."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self._anchor: dict[Hashable, float] = {}
        self._lock = threading.Lock()

    def limit(self, task: Hashable) -> float:
        cfg = self.config
        if cfg.timeout_s is not None:
            return cfg.timeout_s
        with self._lock:
            anchor = self._anchor.get(task)
        if anchor is None:
            return cfg.t_max
        return min(max(cfg.t_min, cfg.factor * anchor), cfg.t_max)

    def observe(self, task: Hashable, seconds: float, reward: float | None) -> None:
        if reward is None or reward <= self.config.success_above:
            return
        with self._lock:
            self._anchor[task] = max(seconds, self._anchor.get(task, 0.0))


@dataclass(frozen=True)
class SubprocessReward:
    """``argv`` run once per response with ``stdin_for(output)`` on its stdin; its stdout parsed by
    ``parse`` (default: the last line as a float). A non-zero exit is a crash."""

    argv: tuple[str, ...]
    stdin_for: Callable[[RequestOutput], str] = field(
        default=lambda out: json.dumps({"text": out.text, "token_ids": out.token_ids}))
    parse: Callable[[str], float] = field(default=lambda stdout: float(stdout.strip().splitlines()[-1]))

    def run(self, output: RequestOutput, timeout: float) -> float:
        proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(self.stdin_for(output), timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise TimeoutError(f"timed out after {timeout:.1f} s") from None
        except BaseException:
            _kill_group(proc)
            raise
        if proc.returncode != 0:
            tail = (stderr.strip().splitlines() or [""])[-1][:200]
            raise RuntimeError(f"exit code {proc.returncode}: {tail}")
        return self.parse(stdout)


def _kill_group(proc: subprocess.Popen) -> None:
    """The command and everything it started (a sandbox's children)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@dataclass(frozen=True)
class RewardResult:
    key: Hashable  # what the caller submitted the response under
    task: Hashable  # what its timeout is anchored by
    reward: float | None  # None when it failed
    seconds: float
    error: str | None = None  # "timed out after 3.0 s", "crashed: ValueError: ...", "exit code 1: ..."

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def timed_out(self) -> bool:
        return self.error is not None and self.error.startswith("timed out")


RewardFn = Callable[[RequestOutput], float] | SubprocessReward


class RewardStage:
    """Scores responses in the background; ``submit`` as each finishes, read ``results()`` /
    ``drain()`` as they come. Use as a context manager (``close`` kills what still runs)."""

    def __init__(self, fn: RewardFn, config: RewardConfig | None = None) -> None:
        self.fn = fn
        self.config = config or RewardConfig()
        self.timeouts = AdaptiveTimeout(self.config)
        self._pool = ThreadPoolExecutor(self.config.max_workers, thread_name_prefix="pat-reward")
        self._done: queue.Queue[RewardResult] = queue.Queue()
        self._submitted = 0
        self._delivered = 0
        self._lock = threading.Lock()

    def __enter__(self) -> "RewardStage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, key: Hashable, output: RequestOutput, task: Hashable | None = None) -> None:
        """Score ``output`` in the background; its result comes back under ``key``. ``task`` anchors
        the adaptive timeout (default: the response's prompt)."""
        task = tuple(output.prompt_token_ids) if task is None else task
        with self._lock:
            self._submitted += 1
        self._pool.submit(self._evaluate, key, task, output)

    @property
    def pending(self) -> int:
        """Submitted and not yet handed out by ``results`` / ``drain``."""
        with self._lock:
            return self._submitted - self._delivered

    def results(self, timeout: float | None = None) -> Iterator[RewardResult]:
        """Every result not handed out yet, as they complete, until none is pending (or ``timeout``
        seconds pass without one: ``TimeoutError``)."""
        while self.pending:
            try:
                result = self._done.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no reward finished within {timeout} s ({self.pending} pending)") from None
            with self._lock:
                self._delivered += 1
            yield result

    def ready(self) -> list[RewardResult]:
        """The results finished so far, without waiting."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            self._delivered += len(out)
        return out

    def drain(self) -> list[RewardResult]:
        """Wait for every pending result."""
        return list(self.results())

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ---- one evaluation, on a pool thread ---------------------------------------------------------------

    def _evaluate(self, key: Hashable, task: Hashable, output: RequestOutput) -> None:
        limit = self.timeouts.limit(task)
        start = time.perf_counter()
        try:
            reward, error = float(self._call(output, limit)), None
        except TimeoutError as exc:
            reward, error = None, str(exc) or f"timed out after {limit:.1f} s"
        except Exception as exc:  # the reward's own failure: recorded for this response, the stage goes on
            reward, error = None, f"crashed: {type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - start
        self.timeouts.observe(task, seconds, reward)
        self._done.put(RewardResult(key, task, reward, seconds, error))

    def _call(self, output: RequestOutput, limit: float) -> float:
        fn = self.fn
        if isinstance(fn, SubprocessReward):
            return fn.run(output, limit)
        if inspect.iscoroutinefunction(fn):
            try:
                return asyncio.run(asyncio.wait_for(fn(output), limit))
            except asyncio.TimeoutError:
                raise TimeoutError(f"timed out after {limit:.1f} s") from None
        return _with_deadline(fn, output, limit)


def _with_deadline(fn: Callable[[RequestOutput], float], output: RequestOutput, limit: float) -> float:
    """``fn(output)`` in a daemon thread; past ``limit`` it is abandoned (Python cannot stop it)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(output)
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    worker = threading.Thread(target=run, name="pat-reward-call", daemon=True)
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        raise TimeoutError(f"timed out after {limit:.1f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]
