"""What a reward is: the one contract the Python runner, ``pat-serve batch --reward`` and the adapters share.

A reward scores one response. It receives a ``RewardInput``: the prompt the engine ran (text, with a
chat template already applied, or token ids), the response's text, the whole ``RequestOutput`` (token
ids, log-probs, finish reason) and the prompt's metadata (a batch line's ``metadata``, a framework's
label or ground truth). It returns a number, or a mapping with a numeric ``"reward"`` whose other
entries are kept as the result's ``info``. Three kinds:

- a Python callable ``fn(item) -> float | dict``, or an ``async def`` one;
- ``SubprocessReward(argv)``: a program run once per response, the way sandboxes and math verifiers
  run. Its stdin is one JSON object, ``RewardInput.to_json()``: ``{"prompt", "response", "token_ids",
  "finish_reason", "metadata"}``; the last non-empty line of its stdout is its result, a number or a
  JSON object with ``"reward"``. A non-zero exit is a failure named by the last line of its stderr;
- ``reward_from_spec(spec)``: ``"package.module:function"`` imports that callable (the working
  directory is searched first, as ``uvicorn app:app`` does); anything else is a command line, split as
  a shell splits it and run without a shell.

``call_reward`` runs any kind under a time limit and a stop event: a subprocess is killed with its
whole process group, an async reward is cancelled, and a plain callable, which Python cannot stop,
is abandoned to a daemon thread.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
import numbers
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pat_engine.errors import InvalidRequestError
from pat_engine.outputs import RequestOutput

POLL_S = 0.05  # how often a running reward looks at its deadline and the stop event


@dataclass(frozen=True)
class RewardInput:
    """One response to score, with what it answered."""

    prompt: Any  # what the engine ran: text (a chat already rendered by its template) or token ids
    response: str  # the response's text ("" when the model has no tokenizer)
    output: RequestOutput  # token ids, log-probs, finish reason
    metadata: Mapping[str, Any] = field(default_factory=dict)  # the prompt's: ground truth, test cases, ...

    def to_json(self) -> dict:
        """What a verifier command reads on stdin."""
        return {"prompt": self.prompt, "response": self.response, "token_ids": list(self.output.token_ids),
                "finish_reason": self.output.finish_reason, "metadata": dict(self.metadata)}


class RewardValueError(ValueError):
    """A reward returned something that is not a reward."""


class RewardCancelled(Exception):
    """The reward stage closed while this evaluation ran."""


def reward_value(value: Any) -> tuple[float, dict]:
    """The reward and its info from what a reward returned (the rule in the module docstring)."""
    info: dict = {}
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise RewardValueError(f'a mapping needs a "reward" entry, got keys {sorted(map(str, value))}')
        info = {k: v for k, v in value.items() if k != "reward"}
        value = value["reward"]
    if not isinstance(value, numbers.Real):
        raise RewardValueError(f"expected a number or {{\"reward\": number, ...}}, got {_short(value)}")
    reward = float(value)
    if not math.isfinite(reward):
        raise RewardValueError(f"the reward is not finite: {reward}")
    return reward, info


def parse_verifier_output(stdout: str) -> Any:
    """A verifier's result: its last non-empty stdout line, a number or a JSON object."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise RewardValueError("the command printed nothing (its last stdout line must be a number or a JSON object)")
    last = lines[-1].strip()
    try:
        return json.loads(last)
    except json.JSONDecodeError:
        raise RewardValueError(f"its last stdout line is not a number or a JSON object: {_short(last)}") from None


@dataclass(frozen=True)
class SubprocessReward:
    """``argv`` run once per response: ``RewardInput.to_json()`` on stdin, the result on stdout."""

    argv: tuple[str, ...]

    def run(self, item: RewardInput, timeout: float, stop: threading.Event) -> Any:
        proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        data = json.dumps(item.to_json()).encode()
        stdout, stderr = _Tail(proc.stdout), _Tail(proc.stderr)  # bounded: the result is the last line
        feeder = threading.Thread(target=_feed, args=(proc.stdin, data), daemon=True)
        feeder.start()
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    proc.wait(timeout=max(min(POLL_S, deadline - time.monotonic()), 0))
                    break
                except subprocess.TimeoutExpired:
                    _check(deadline, timeout, stop)
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            for t in (feeder, stdout, stderr):
                t.join(POLL_S * 20)
        if proc.returncode != 0:
            tail = (stderr.text().strip().splitlines() or [""])[-1][:200]
            raise RuntimeError(f"exit code {proc.returncode}: {tail}")
        return parse_verifier_output(stdout.text())


TAIL_BYTES = 64 << 10  # what is kept of a verifier's stdout and stderr: whatever it prints, memory stays bounded


class _Tail(threading.Thread):
    """Reads a pipe to its end, keeping only its last ``TAIL_BYTES``."""

    def __init__(self, pipe):
        super().__init__(daemon=True)
        self.pipe, self.kept = pipe, b""
        self.start()

    def run(self) -> None:
        with self.pipe:
            for chunk in iter(lambda: self.pipe.read1(TAIL_BYTES), b""):
                self.kept = (self.kept + chunk)[-TAIL_BYTES:]

    def text(self) -> str:
        return self.kept.decode(errors="replace")


def _feed(pipe, data: bytes) -> None:
    """The response to stdin; a verifier that exits without reading it all is no error."""
    try:
        with pipe:
            pipe.write(data)
    except (BrokenPipeError, OSError):
        pass


RewardFn = Callable[[RewardInput], Any] | SubprocessReward


def call_reward(fn: RewardFn, item: RewardInput, limit: float, stop: threading.Event) -> tuple[float, dict]:
    """Score ``item`` within ``limit`` seconds: ``TimeoutError`` past it, ``RewardCancelled`` once ``stop`` is set."""
    if isinstance(fn, SubprocessReward):
        value = fn.run(item, limit, stop)
    elif inspect.iscoroutinefunction(fn):
        value = asyncio.run(_bounded(fn, item, limit, stop))
    else:
        value = _in_thread(fn, item, limit, stop)
    return reward_value(value)


def reward_from_spec(spec: str) -> RewardFn:
    """``"module:function"`` -> that callable; anything else -> a ``SubprocessReward`` of the command line."""
    spec = spec.strip()
    if re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", spec):
        return _entry_point(spec)
    try:
        argv = tuple(shlex.split(spec))
    except ValueError as exc:
        raise InvalidRequestError(f"reward command {spec!r}: {exc}") from None
    if not argv:
        raise InvalidRequestError("the reward is empty: give a command or a module:function")
    if shutil.which(argv[0]) is None:
        raise InvalidRequestError(f"reward command {spec!r}: {argv[0]!r} is not an executable file or on PATH")
    return SubprocessReward(argv)


# ---- helpers ------------------------------------------------------------------------------------------


def _entry_point(spec: str) -> Callable[[RewardInput], Any]:
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidRequestError(f"reward {spec!r}: cannot import {module_name!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise InvalidRequestError(f"reward {spec!r}: {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise InvalidRequestError(f"reward {spec!r}: {attr!r} is not callable")
    return obj


def _check(deadline: float, limit: float, stop: threading.Event) -> None:
    if stop.is_set():
        raise RewardCancelled("cancelled: the reward stage was closed")
    if time.monotonic() >= deadline:
        raise TimeoutError(f"timed out after {limit:.1f} s")


async def _bounded(fn: Callable, item: RewardInput, limit: float, stop: threading.Event) -> Any:
    task = asyncio.ensure_future(fn(item))
    deadline = time.monotonic() + limit
    try:
        while not task.done():
            _check(deadline, limit, stop)
            await asyncio.wait({task}, timeout=POLL_S)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task.result()


def _in_thread(fn: Callable, item: RewardInput, limit: float, stop: threading.Event) -> Any:
    """``fn(item)`` in a daemon thread; past ``limit`` (or once stopped) it is abandoned: Python cannot stop it."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(item)
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    worker = threading.Thread(target=run, name="pat-reward-call", daemon=True)
    worker.start()
    deadline = time.monotonic() + limit
    while worker.is_alive():
        _check(deadline, limit, stop)
        worker.join(POLL_S)
    if "error" in box:
        raise box["error"]
    return box["value"]


def _kill_group(proc: subprocess.Popen) -> None:
    """The command and everything it started (a sandbox's children)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
