"""``pat-serve serve`` as a process (free port, SIGTERM), ``pat-serve plot``, ``pat-serve demo``, and the engine flags
the commands share."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time

import argparse

import httpx
import pytest
import torch

from pat_engine.config import EngineConfig
from pat_engine.errors import InvalidRequestError
from pat_engine.parallel.layout import Layout
from pat_engine.serve.batch.report import layout_segments
from pat_engine.serve.engine_args import EngineArgs, add_engine_args
from serve_cli_util import cli_cmd, cli_env, run_cli

TIMELINE = {
    "points": [{"t": 0.1 * i, "layout": "TP1xDP4" if i < 10 else "TP4xDP1", "active": max(1, 20 - 2 * i),
                "tokens_per_s": 1000.0 / (1 + i)} for i in range(20)],
    "switches": [{"t": 1.05, "from_layout": "TP1xDP4", "to_layout": "TP4xDP1", "reason": "schedule", "kv_path": "migrate",
                  "seconds": 0.05, "costs": {"kv_s": 0.01}, "decision": {}, "ok": True, "error": None}],
}


@pytest.mark.slow
def test_serve_process_on_a_free_port_stops_cleanly_on_sigterm(model_dir):
    proc = subprocess.Popen(cli_cmd("serve", "--model", model_dir("llama"), "--port", 0, "--served-model-name", "tiny",
                                    "--dtype", "float64"),
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # printed once the engine is up and the socket bound
        match = re.search(r"on (http://127\.0\.0\.1:(\d+))", line)
        assert match and int(match.group(2)) > 0, line + proc.stderr.read()
        url = match.group(1)
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 5,
                                                      "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "pat-serve: stopped" in out


def test_layout_segments_leave_out_the_switch():
    segs = layout_segments(TIMELINE)
    assert [s[2] for s in segs] == ["TP1xDP4", "TP4xDP1"]
    assert segs[0][1] == 1.0 and segs[1][0] == 1.05  # the switch itself (1.00-1.05 s) is drawn hatched


@pytest.mark.slow  # runs the CLI in a subprocess
def test_plot_command(tmp_path):
    tl = tmp_path / "timeline.json"
    tl.write_text(json.dumps(TIMELINE))
    r = run_cli("plot", tl, "-o", tmp_path / "plot.png", "--title", "test run")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    r = run_cli("plot", tmp_path / "missing.json", "-o", tmp_path / "x.png")
    assert r.returncode == 1 and "cannot read timeline" in r.stderr


@pytest.mark.slow
def test_demo_creates_its_model_and_switches_live(tmp_path):
    """A small demo (the README's command with a smaller batch): fresh cache dir, no download."""
    model_dir, out_dir = tmp_path / "cache" / "tiny-llama", tmp_path / "demo"
    r = run_cli("demo", "--model-dir", model_dir, "--out-dir", out_dir, "--requests", 12, "--world", 2,
                "--tail-tokens", 64, "--no-progress", timeout=240)
    assert r.returncode == 0, r.stderr
    assert "(created, built-in tiny Llama" in r.stdout and (model_dir / "config.json").is_file()
    summary = re.search(r"pat-serve demo: 12 requests \(0 errors\), (\d+) tokens, .* (\d+) switches", r.stdout)
    assert summary and int(summary.group(2)) >= 1, r.stdout
    assert f"report: {out_dir / 'report.png'}" in r.stdout and (out_dir / "report.png").stat().st_size > 10_000
    results = [json.loads(line) for line in (out_dir / "results.jsonl").read_text().splitlines()]
    prompts = [json.loads(line) for line in (out_dir / "prompts.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in results) == sorted(p["id"] for p in prompts)
    assert all(len(r["token_ids"]) == p["max_tokens"] for r, p in
               zip(sorted(results, key=lambda r: r["id"]), sorted(prompts, key=lambda p: p["id"])))


def test_engine_flags_take_vllms_names_and_leave_what_is_not_given_to_the_config():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(["--model", "m", "--tensor-parallel-size", "2", "--data-parallel-size", "2", "--device", "cpu",
                       "--gpu-memory-utilization", "0.5", "--enforce-eager", "--max-num-seqs", "32",
                       "--max-num-batched-tokens", "2048", "--no-enable-prefix-caching", "--block-size", "32",
                       "--attention-backend", "torch", "--switch-keeps-prefix-cache", "--max-tp", "16",
                       "--tokenizer", "tok", "--chat-template", "chat.jinja"])
    args = EngineArgs.from_namespace(ns)
    assert args.layout() == Layout(2, 2)
    given = dict(device="cpu", gpu_memory_utilization=0.5, enforce_eager=True, max_num_seqs=32,
                 max_num_batched_tokens=2048, enable_prefix_caching=False, block_size=32, attention_backend="torch",
                 switch_keeps_prefix_cache=True, max_tp=16, tokenizer="tok", chat_template="chat.jinja")
    kwargs = args.engine_kwargs()
    assert {k: kwargs[k] for k in given} == given
    cfg = EngineConfig.from_kwargs("m", tp=2, dp=2, **kwargs)  # every flag is a field the config checks
    assert cfg.graphs() is None and not cfg.enable_prefix_caching and cfg.switch_keeps_prefix_cache
    assert cfg.max_tp == 16
    with pytest.raises(InvalidRequestError, match="max_tp must be a power of two"):
        EngineConfig.from_kwargs("m", tp=2, dp=2, **{**kwargs, "max_tp": 6})

    plain = EngineArgs.from_namespace(p.parse_args(["--model", "m"])).engine_kwargs()
    assert plain["device"] == ("cuda" if torch.cuda.is_available() else "cpu") and plain["enforce_eager"] is False
    assert not {"gpu_memory_utilization", "max_num_seqs", "block_size", "enable_prefix_caching",
                "switch_keeps_prefix_cache", "max_tp", "tokenizer", "chat_template"} & set(plain)
    for bad in (["--device", "tpu"], ["--attention-backend", "fast"]):
        with pytest.raises(SystemExit):
            p.parse_args(["--model", "m", *bad])
