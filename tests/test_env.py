"""The PAT_* switches: one home (pat_engine/env.py), read on every call so tests and A/B runs can flip them."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from pat_engine import env
from pat_engine.model import cpu_gemm
from pat_engine.parallel import shm_collectives
from pat_engine.serve.demo import DemoConfig

PACKAGE = Path(__file__).resolve().parents[1] / "pat_engine"


def test_switches_are_read_on_every_call(monkeypatch, tmp_path):
    monkeypatch.setenv("PAT_CPU_GEMM", " Torch ")
    assert not env.cpu_gemm_packing() and not cpu_gemm.packing_enabled("cpu", torch.float32)
    monkeypatch.delenv("PAT_CPU_GEMM")
    assert env.cpu_gemm_packing()
    monkeypatch.setenv("PAT_CPU_COLLECTIVES", "gloo")
    assert not env.shm_collectives() and not shm_collectives.usable("gloo")
    monkeypatch.delenv("PAT_API_KEY", raising=False)
    assert env.api_key() is None
    monkeypatch.setenv("PAT_API_KEY", "k")
    assert env.api_key() == "k"
    monkeypatch.setenv("PAT_ENGINE_CACHE", str(tmp_path))
    assert DemoConfig().model_dir == tmp_path / "tiny-llama"


def test_no_pat_switch_is_read_outside_env():
    """A string literal naming a PAT_ variable anywhere else in the package is a second home."""
    names = {s.name for s in env.SWITCHES}
    bad = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "env.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                bad.setdefault(str(path.relative_to(PACKAGE)), []).append(node.value)
    assert not bad, f"read these through pat_engine.env: {bad}"


def test_the_triton_sampler_is_on_for_cuda_by_default_and_for_the_cpu_only_when_asked(monkeypatch):
    """auto (unset): CUDA tensors only, so the interpreter never draws a CPU engine's rows unasked; on: the CPU
    too where the interpreter runs Triton; off: nowhere (the torch twin, for A/B runs)."""
    monkeypatch.setattr(env, "triton_runs_on", lambda kind: True)  # Triton importable, the interpreter on
    monkeypatch.delenv("PAT_TRITON_SAMPLER", raising=False)
    assert env.triton_sampler("cuda") and not env.triton_sampler("cpu")
    monkeypatch.setenv("PAT_TRITON_SAMPLER", " On ")
    assert env.triton_sampler("cuda") and env.triton_sampler("cpu")
    monkeypatch.setenv("PAT_TRITON_SAMPLER", "off")
    assert not env.triton_sampler("cuda") and not env.triton_sampler("cpu")
    monkeypatch.setattr(env, "triton_runs_on", lambda kind: False)  # no Triton: never, whatever is asked
    monkeypatch.setenv("PAT_TRITON_SAMPLER", "on")
    assert not env.triton_sampler("cuda")
