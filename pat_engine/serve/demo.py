"""``pat-serve demo``: a long-tail batch on the built-in tiny model, with live layout switching, on CPU.

Creates the tiny checkpoint (no download) under a cache directory if it is
absent, writes a batch of prompts whose answers range from a dozen tokens to
a few hundred, runs it on four CPU worker processes starting at TP1xDP4, and
prints the summary and where the report is. With a profile table the
controller decides when to switch; without one, a fixed schedule merges the
replicas as the batch drains (TP2xDP2 when the short answers are done, TP4
for the last long ones).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from pat_engine import env
from pat_engine.serve.batch.job import BatchJob, run_batch
from pat_engine.serve.batch.lines import SamplingDefaults
from pat_engine.serve.engine_args import EngineArgs
from pat_engine.serve.batch.summary import RunSummary
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model

PROFILE_NAME = "pat_profile.json"  # a table placed next to the demo model turns the controller on
_WORDS = ("prove that the sum of two odd integers is even then compute the remainder when a large prime "
          "is divided by six and explain each step of the answer in words").split()


def default_model_dir() -> Path:
    """Where the demo's tiny model lives unless told: under ``PAT_ENGINE_CACHE`` (read now, not at import)."""
    return env.engine_cache() / "tiny-llama"


@dataclass(frozen=True)
class DemoConfig:
    model_dir: Path = field(default_factory=default_model_dir)
    out_dir: Path = Path("pat-demo")
    requests: int = 48
    world: int = 4
    tail_tokens: int = 400  # the longest answers; short and medium ones scale with it
    profile: Path | None = None
    progress: bool = True
    seed: int = 0


def ensure_tiny_model(path: Path) -> bool:
    """Write the built-in tiny model to ``path`` unless it is there; True when it was created."""
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    write_tiny_model(tmp, TinyModelSpec())  # written aside, then renamed: an interrupted write leaves no half model
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return True


# answer-length bands as fractions of the tail: (share of requests, low, high); 400 tokens: 12-48, 96-160, 320-400
_BANDS = {"short": (0.80, 0.03, 0.12), "medium": (0.15, 0.24, 0.40), "long": (0.05, 0.80, 1.00)}


def _band(name: str, tail: int) -> tuple[int, int]:
    _, lo, hi = _BANDS[name]
    return max(1, round(lo * tail)), max(1, round(hi * tail))


def long_tail_lengths(n: int, seed: int, tail: int = 400) -> list[int]:
    """Answer lengths with a long tail: ~80% short, ~15% medium, ~5% (at least one) close to ``tail``."""
    rng = random.Random(seed)
    n_long = max(1, round(n * _BANDS["long"][0]))
    n_mid = max(1, round(n * _BANDS["medium"][0]))
    lengths = [rng.randint(*_band("long", tail)) for _ in range(n_long)]
    lengths += [rng.randint(*_band("medium", tail)) for _ in range(n_mid)]
    lengths += [rng.randint(*_band("short", tail)) for _ in range(max(0, n - len(lengths)))]
    rng.shuffle(lengths)
    return lengths


def write_prompts(path: Path, lengths: list[int], seed: int) -> None:
    rng = random.Random(seed + 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, n in enumerate(lengths):
            prompt = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 24)))
            f.write(json.dumps({"id": f"demo-{i}", "prompt": prompt, "max_tokens": n, "ignore_eos": True}) + "\n")


def drain_schedule(lengths: list[int], world: int, tail: int) -> list[tuple[int, int]]:
    """Merge replicas as the batch drains: half the DP groups once the short answers are done, one at the end."""
    short_hi, mid_hi = _band("short", tail)[1], _band("medium", tail)[1]
    short = max((n for n in lengths if n <= short_hi), default=0)
    mid = max((n for n in lengths if short_hi < n <= mid_hi), default=short)
    steps = [(short + 2, max(1, world // 2)), (mid + 2, world)]
    return [(s, tp) for s, tp in steps if tp > 1]


@dataclass(frozen=True)
class DemoResult:
    summary: RunSummary
    paths: dict[str, Path]
    profile: Path | None  # the table the controller used; None: the fixed schedule ran


def run_demo(cfg: DemoConfig) -> DemoResult:
    created = ensure_tiny_model(cfg.model_dir)
    print(f"model: {cfg.model_dir} ({'created' if created else 'cached'}, built-in tiny Llama, random weights)")
    lengths = long_tail_lengths(cfg.requests, cfg.seed, cfg.tail_tokens)
    paths = {name: cfg.out_dir / name for name in ("prompts.jsonl", "results.jsonl", "timeline.json", "report.png")}
    write_prompts(paths["prompts.jsonl"], lengths, cfg.seed)
    profile = cfg.profile or (cfg.model_dir / PROFILE_NAME if (cfg.model_dir / PROFILE_NAME).is_file() else None)
    schedule = None if profile else drain_schedule(lengths, cfg.world, cfg.tail_tokens)
    how = f"controller, table {profile}" if profile else "fixed schedule " + ", ".join(f"step {s}: TP{tp}" for s, tp in schedule)
    print(f"batch: {len(lengths)} requests, answers {min(lengths)}-{max(lengths)} tokens; world {cfg.world} "
          f"starting at TP1xDP{cfg.world}; switching: {how}")
    args = EngineArgs(str(cfg.model_dir), tp=1, world=cfg.world, dtype="float32", device="cpu",
                      profile=str(profile) if profile else None,
                      switch_schedule=tuple(schedule) if schedule else None)
    job = BatchJob(paths["prompts.jsonl"], paths["results.jsonl"], "tiny-llama", SamplingDefaults(), overwrite=True,
                   progress=cfg.progress, timeline=paths["timeline.json"], report=paths["report.png"])
    engine = args.build()
    try:
        summary = run_batch(engine, job)
    finally:
        engine.shutdown()
    return DemoResult(summary, paths, profile)
