"""The reward stage: each response scored as soon as it finishes, while the rest still generate.

What a reward is (a callable, an ``async def``, a verifier command) and what it receives and returns
is ``reward_fns.py``'s contract. ``RewardStage`` runs rewards in a bounded pool of ``max_workers``
threads, concurrently with generation, and streams ``RewardResult``s as they complete. A timeout,
a crash or a result that is not a reward becomes that response's recorded failure (``error``,
reward None): never a lost response, a hung step or a dead engine.

Timeouts follow RollPacker's adaptive rule per task (a test case, a prompt): with ``T_anchor``
the longest evaluation so far that succeeded (reward above ``success_above``), the limit is
``min(max(t_min, factor * T_anchor), t_max)``, and ``t_max`` until one has succeeded. Doomed
executions (an infinite loop, a slow wrong answer) fail fast once correct ones are known.

What can be stopped, at the limit or when the stage closes: a subprocess is killed with its whole
process group; an async reward is cancelled; a plain callable cannot be interrupted in Python, so
it is recorded as timed out and left to finish in a daemon thread that holds no pool slot (use a
subprocess for code that may never return).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Hashable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pat_engine.outputs import RequestOutput
from pat_engine.rollout.reward_fns import (
    RewardCancelled,
    RewardFn,
    RewardInput,
    RewardValueError,
    SubprocessReward,
    call_reward,
)

__all__ = ["AdaptiveTimeout", "RewardConfig", "RewardFn", "RewardInput", "RewardResult", "RewardStage",
           "SubprocessReward"]


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
class RewardResult:
    key: Hashable  # what the caller submitted the response under
    task: Hashable  # what its timeout is anchored by
    reward: float | None  # None when it failed
    seconds: float
    error: str | None = None  # "timed out after 3.0 s", "crashed: ValueError: ...", "exit code 1: ...", "bad result: ..."
    info: dict = field(default_factory=dict)  # what a mapping result held besides "reward"

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def timed_out(self) -> bool:
        return self.error is not None and self.error.startswith("timed out")


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
        self._stop = threading.Event()  # set by close: running evaluations end as cancelled

    def __enter__(self) -> "RewardStage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, key: Hashable, output: RequestOutput, task: Hashable | None = None, *, prompt: Any = None,
               metadata: Mapping[str, Any] | None = None) -> None:
        """Score ``output`` in the background; its result comes back under ``key``. ``task`` anchors
        the adaptive timeout (default: the response's prompt); ``prompt`` (default: the output's prompt
        text, else its token ids) and ``metadata`` are handed to the reward with the response."""
        if prompt is None:
            prompt = output.prompt if output.prompt is not None else list(output.prompt_token_ids)
        item = RewardInput(prompt, output.text or "", output, dict(metadata or {}))
        task = tuple(output.prompt_token_ids) if task is None else task
        with self._lock:
            self._submitted += 1
        self._pool.submit(self._evaluate, key, task, item)

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
        """Stop: evaluations not started are dropped, running ones end as cancelled (a verifier's
        process group is killed)."""
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ---- one evaluation, on a pool thread ---------------------------------------------------------------

    def _evaluate(self, key: Hashable, task: Hashable, item: RewardInput) -> None:
        limit = self.timeouts.limit(task)
        start = time.perf_counter()
        reward, info, error = None, {}, None
        try:
            reward, info = call_reward(self.fn, item, limit, self._stop)
        except (TimeoutError, RewardCancelled) as exc:
            error = str(exc)
        except RewardValueError as exc:
            error = f"bad result: {exc}"
        except Exception as exc:  # the reward's own failure: recorded for this response, the stage goes on
            error = f"crashed: {type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - start
        self.timeouts.observe(task, seconds, reward)
        self._done.put(RewardResult(key, task, reward, seconds, error, info))

