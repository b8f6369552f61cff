"""``pat-serve batch`` through the real command: both input formats, bad lines, live switching, resume after a kill."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from conftest import hf_greedy
from pat_engine.serve.batch.lines import SamplingDefaults, finished_keys, parse_line, record_key, LineError
from serve_cli_util import cli_cmd, cli_env, read_jsonl, run_cli, write_jsonl

CHAT = [{"role": "user", "content": "what is the sum of two odd numbers"}]


# ---- line formats (no engine) ----------------------------------------------------------------------


def test_finished_keys_cuts_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "text": "x", "error": null}\n'
                   '{"id": "line-4", "line": 4, "error": "line 4: invalid JSON"}\n'
                   '{"id": null, "custom_id": "c1", "response": {}, "error": null}\n'
                   '{"id": "b", "text": "half a rec')  # the process was killed mid-write
    assert finished_keys(out) == {"a", "line-4", "c1"}
    assert out.read_text().endswith("null}\n")  # the torn line is gone, so appending starts clean


def test_record_keys_of_both_formats():
    assert record_key({"id": 7, "text": ""}) == "7"
    assert record_key({"id": "batch_req_1", "custom_id": "q1", "response": {}}) == "q1"
    assert record_key({"id": "batch_req_2", "custom_id": None, "error": {"line": 5}}) == "line-5"


def test_parse_line_names_the_problem():
    defaults = SamplingDefaults(max_tokens=9)
    item = parse_line(3, {"input_ids": [1, 2], "temperature": 0.5}, None, 64, defaults)
    assert (item.key, item.input.params.max_new_tokens, item.input.params.temperature) == ("line-3", 9, 0.5)
    cases = [
        ({"id": "x", "prompt": "a", "temprature": 1}, "line 4: temprature: unknown field"),
        ({"id": "x", "prompt": "a", "input_ids": [1]}, "exactly one of prompt, messages, input_ids"),
        ({"id": "x", "input_ids": [1], "max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
        ({"id": "x", "input_ids": [1], "top_k": 5, "min_tokens": 99, "max_tokens": 3}, "min_new_tokens"),
        ({"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {}}, "url: Input should be"),
        ({"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": [1], "stream": True}},
         "stream mode"),
        ([1, 2], "expected a JSON object"),
    ]
    for obj, message in cases:
        with pytest.raises(LineError, match=message):
            parse_line(4, obj, None, 64, defaults)


# ---- the real command ------------------------------------------------------------------------------


@pytest.mark.slow
def test_pat_style_batch_with_live_switch_and_bad_lines(tmp_path, model_dir):
    model = model_dir("llama")
    rows = [
        {"id": "a", "input_ids": [5, 6, 7], "max_tokens": 24},
        {"id": "b", "input_ids": [100, 20, 30, 40, 50, 60, 70], "max_tokens": 40},
        {"id": 7, "prompt": "the answer is", "max_tokens": 8, "logprobs": True},
        {"id": "chat", "messages": CHAT, "max_tokens": 6},
        '{"id": "broken", "prompt": ',
        {"id": "typo", "prompt": "x", "temprature": 0.5},
        {"id": "long", "input_ids": [5] * 300, "max_tokens": 4},
        {"id": "both", "prompt": "x", "input_ids": [1]},
        {"id": "a", "input_ids": [1, 2]},
        {"input_ids": [9, 10, 11], "max_tokens": 30},
        {"id": "neg", "input_ids": [1], "max_tokens": -5},
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out, report, timeline = tmp_path / "out.jsonl", tmp_path / "report.png", tmp_path / "timeline.json"
    r = run_cli("batch", "--model", model, "--input", inp, "--output", out, "--world", 2, "--dtype", "float64",
                "--max-model-len", 256, "--switch-schedule", "6:2", "--report", report, "--timeline", timeline)
    assert r.returncode == 0, r.stderr
    recs = {rec["line"]: rec for rec in read_jsonl(out)}
    assert sorted(recs) == list(range(1, 12))
    for line, prompt, n in ((1, [5, 6, 7], 24), (2, [100, 20, 30, 40, 50, 60, 70], 40), (10, [9, 10, 11], 30)):
        assert recs[line]["token_ids"] == hf_greedy(model, prompt, n), f"line {line}"
        assert recs[line]["error"] is None and recs[line]["usage"]["completion_tokens"] == n
    assert recs[10]["id"] == "line-10" and recs[3]["id"] == 7 and len(recs[3]["logprobs"]) == 8
    assert recs[4]["text"] and recs[4]["finish_reason"] == "length"
    errors = {
        5: "line 5: invalid JSON", 6: "line 6: temprature: unknown field", 7: "line 7: prompt has 300 tokens but the context holds 256",
        8: "line 8: give exactly one of", 9: "line 9: duplicate id 'a' (first on line 1)",
        11: "line 11: max_tokens: Input should be greater than or equal to 1",
    }
    for line, message in errors.items():
        assert recs[line]["error"].startswith(message), recs[line]
    # live switch, summary, progress bar and report
    assert "pat-serve batch: 11 requests (6 errors)" in r.stdout and "1 switches (TP1xDP2->TP2xDP1" in r.stdout
    assert "tok/s" in r.stderr and "switches" in r.stderr and "TP2xDP1" in r.stderr
    tl = json.loads(timeline.read_text())
    assert [(s["from_layout"], s["to_layout"]) for s in tl["switches"]] == [("TP1xDP2", "TP2xDP1")]
    assert tl["summary"]["requests"] == 11 and tl["points"]
    assert report.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_openai_batch_format(tmp_path, model_dir):
    from transformers import AutoTokenizer

    model = model_dir("llama")
    tok = AutoTokenizer.from_pretrained(model)

    def line(cid: str, url: str, **body) -> dict:
        return {"custom_id": cid, "method": "POST", "url": url, "body": body}

    rows = [
        line("chat-1", "/v1/chat/completions", model="gpt-4o-mini", messages=CHAT, max_tokens=5, temperature=0),
        line("cmpl-1", "/v1/completions", prompt="the answer is", max_tokens=6, temperature=0, return_token_ids=True),
        line("stream", "/v1/completions", prompt="x", stream=True),
        line("emb", "/v1/embeddings", input="x"),
        "not json at all",
        line("typo", "/v1/chat/completions", messages=CHAT, max_tokens=5, bogus=1),
    ]
    out = tmp_path / "out.jsonl"
    r = run_cli("batch", "--model", model, "--input", write_jsonl(tmp_path / "in.jsonl", rows), "--output", out,
                "--dtype", "float64", "--served-model-name", "tiny", "--no-progress")
    assert r.returncode == 0, r.stderr
    recs = read_jsonl(out)
    assert len(recs) == 6 and all(rec["id"].startswith("batch_req") for rec in recs)
    by_id = {rec["custom_id"]: rec for rec in recs}
    chat = by_id["chat-1"]
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    body = chat["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"][0]["message"]["role"] == "assistant" and body["usage"]["completion_tokens"] == 5
    cmpl = by_id["cmpl-1"]["response"]["body"]
    prompt_ids = tok("the answer is")["input_ids"]
    assert cmpl["object"] == "text_completion"
    assert cmpl["choices"][0]["token_ids"] == hf_greedy(model, prompt_ids, 6)
    assert cmpl["choices"][0]["text"] == tok.decode(cmpl["choices"][0]["token_ids"], skip_special_tokens=True)
    for cid, line_no, message in (("stream", 3, "stream mode"), ("emb", 4, "url: Input should be"),
                                  (None, 5, "invalid JSON"), ("typo", 6, "bogus: unknown field")):
        rec = by_id[cid]
        assert rec["response"]["status_code"] == 400 and rec["response"]["body"] is None
        assert rec["error"]["line"] == line_no and rec["error"]["code"] == 400
        assert rec["error"]["message"].startswith(f"line {line_no}: ") and message in rec["error"]["message"]


@pytest.mark.slow  # runs the CLI in a subprocess
def test_refuses_to_clobber_and_missing_input(tmp_path):
    out = write_jsonl(tmp_path / "out.jsonl", [{"id": "x", "text": ""}])
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    r = run_cli("batch", "--model", tmp_path, "--input", inp, "--output", out)
    assert r.returncode == 1 and "exists; pass --resume" in r.stderr
    r = run_cli("batch", "--model", tmp_path, "--input", tmp_path / "nope.jsonl", "--output", tmp_path / "o.jsonl")
    assert r.returncode == 1 and "does not exist" in r.stderr


@pytest.mark.slow
def test_resume_after_kill(tmp_path, model_dir):
    """Kill the job midway (SIGKILL), rerun with --resume: every id exactly once, nothing rewritten."""
    n = 16  # request i generates 8 * (i + 1) tokens: one finishes every 8 decode steps
    rows = [{"id": f"r{i}", "input_ids": [5 + i, 6, 7], "max_tokens": 8 * (i + 1), "ignore_eos": True} for i in range(n)]
    inp, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    args = ["batch", "--model", model_dir("llama"), "--input", inp, "--output", out, "--dtype", "float32",
            "--no-progress"]
    proc = subprocess.Popen(cli_cmd(*args), env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_text().count("\n") >= 3):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "no results within 120 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
        proc.stderr.close()
    text = out.read_text()
    first = [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]  # not a torn one
    assert 3 <= len(first) < n, "the kill must land midway through the job"
    r = run_cli("batch", *args[1:], "--resume")
    assert r.returncode == 0, r.stderr
    assert f"{n - len(first)} requests (0 errors, {len(first)} skipped)" in r.stdout
    recs = read_jsonl(out)
    assert recs[:len(first)] == first  # the first run's results are kept as they were
    ids = [rec["id"] for rec in recs]
    assert len(ids) == len(set(ids)) == n and set(ids) == {row["id"] for row in rows}
    assert all(len(rec["token_ids"]) == 8 * (int(rec["id"][1:]) + 1) for rec in recs)
