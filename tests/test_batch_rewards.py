"""``pat-serve batch --reward``: every answer scored as it finishes, with its line's prompt and metadata;
a failed reward is a per-line error that keeps the answers; no line is lost (plain and tail-batched jobs)."""

from __future__ import annotations

import json
import sys
import time

import pytest

from pat_engine.outputs import RequestOutput
from pat_engine.rollout.reward_fns import RewardInput, SubprocessReward
from pat_engine.rollout.rewards import RewardConfig, RewardResult
from pat_engine.serve.batch.lines import LineError, SamplingDefaults, parse_line, result_record
from pat_engine.serve.batch.scoring import BatchReward, LineScorer
from pat_engine.serve.cli import main
from serve_cli_util import read_jsonl, run_cli, write_jsonl

DEFAULTS = SamplingDefaults(max_tokens=8)

# the verifier of these tests: a function of the answer's tokens and its line's metadata, so a reward
# written beside the wrong answer shows; metadata asks it to crash or to hang
VERIFIER = """\
import json, sys, time
item = json.load(sys.stdin)
meta = item["metadata"]
if meta.get("crash"):
    sys.exit("sandbox crashed")
if meta.get("hang"):
    time.sleep(60)
print("verifier log line")
print(json.dumps({"reward": sum(item["token_ids"]) % 7 + meta.get("bonus", 0),
                  "prompt_kind": type(item["prompt"]).__name__, "finish": item["finish_reason"]}))
"""


def expected(token_ids: list[int], meta: dict) -> float:
    return float(sum(token_ids) % 7 + meta.get("bonus", 0))


def out(tokens: list[int], index: int = 0) -> RequestOutput:
    return RequestOutput("r", [1, 2], tokens, "t", "stop", sample_index=index)


def ok(reward: float, info: dict | None = None) -> RewardResult:
    return RewardResult(0, 0, reward, 0.1, None, info or {})


# ---- lines and records (no engine) ------------------------------------------------------------------


def test_lines_carry_metadata_in_both_styles_and_a_bad_one_is_named():
    item = parse_line(1, {"input_ids": [1, 2], "metadata": {"answer": "4"}}, None, 64, DEFAULTS)
    assert item.metadata == {"answer": "4"} and item.input.params.max_new_tokens == 8
    oa = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": [1, 2]},
          "metadata": {"tests": [1]}}
    assert parse_line(2, oa, None, 64, DEFAULTS).metadata == {"tests": [1]}
    assert parse_line(3, {"input_ids": [1]}, None, 64, DEFAULTS).metadata == {}
    with pytest.raises(LineError, match="metadata: Input should be a valid dictionary"):
        parse_line(4, {"input_ids": [1], "metadata": [1]}, None, 64, DEFAULTS)
    with pytest.raises(LineError, match="line 5: metadata must be a JSON object, got list"):
        parse_line(5, {**oa, "metadata": [1]}, None, 64, DEFAULTS)


def test_records_carry_each_answers_reward_and_a_failed_reward_keeps_the_answers():
    item = parse_line(3, {"id": "q", "input_ids": [1, 2], "n": 2}, None, 64, DEFAULTS)
    outs = [out([5]), out([6], 1)]
    rec = result_record(item, outs, None, "m", [ok(1.0, {"why": "x"}), ok(0.0)])
    assert (rec["reward"], rec["reward_info"], rec["error"]) == (1.0, {"why": "x"}, None)
    assert [(s["token_ids"], s["reward"]) for s in rec["samples"]] == [([5], 1.0), ([6], 0.0)]
    failed = RewardResult(0, 0, None, 2.0, "timed out after 2.0 s")
    rec = result_record(item, outs, None, "m", [ok(1.0), failed])
    assert rec["error"] == "line 3: reward of answer 1 failed: timed out after 2.0 s"
    assert [s["token_ids"] for s in rec["samples"]] == [[5], [6]] and rec["samples"][1]["reward"] is None
    assert "reward" not in result_record(item, outs, None, "m")  # without --reward the record is as before

    oa = parse_line(4, {"custom_id": "c", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": [1, 2], "n": 2}}, None, 64, DEFAULTS)
    rec = result_record(oa, outs, None, "m", [ok(0.5), failed])
    assert rec["rewards"] == [0.5, None] and rec["response"]["status_code"] == 200
    assert rec["error"]["type"] == "RewardError" and "reward of answer 1 failed" in rec["error"]["message"]


def test_the_scorer_writes_a_line_once_all_its_answers_are_scored():
    written = []

    def score(item: RewardInput) -> float:
        time.sleep(0.3 if item.metadata["slow"] else 0.0)
        return float(sum(item.output.token_ids))

    scorer = LineScorer(BatchReward(score, RewardConfig(max_workers=4, timeout_s=10)),
                        lambda item, outs, rewards: written.append((item.line, [r.reward for r in rewards])))
    slow = parse_line(1, {"input_ids": [1], "n": 2, "metadata": {"slow": True}}, None, 64, DEFAULTS)
    fast = parse_line(2, {"input_ids": [1], "metadata": {"slow": False}}, None, 64, DEFAULTS)
    scorer.finished(slow, [out([3]), out([4], 1)])
    scorer.finished(fast, [out([9])])
    time.sleep(0.1)
    scorer.poll()
    assert written == [(2, [9.0])]  # the fast line is out; the slow one waits for both its answers
    scorer.finish()
    scorer.close()
    assert written == [(2, [9.0]), (1, [3.0, 4.0])]
    assert (scorer.counts.scored, scorer.counts.failed) == (3, 0) and scorer.counts.wait_s > 0.1


class _ChatTokenizer:
    """A stand-in with a chat template: renders "<role>content" pieces, one id per character."""

    chat_template = "stand-in"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_a_chat_lines_reward_gets_the_text_its_template_rendered():
    """The prompt a reward sees for a chat line is the rendered chat (its docstring's promise), not the
    token ids the engine ran, in the pat style and the OpenAI batch style alike."""
    seen = []
    scorer = LineScorer(BatchReward(lambda item: seen.append(item.prompt) or 1.0, RewardConfig(max_workers=1)),
                        lambda item, outs, rewards: None)
    pat = parse_line(1, {"messages": [{"role": "user", "content": "2+2?"}]}, _ChatTokenizer(), 64, DEFAULTS)
    openai = parse_line(2, {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                            "body": {"model": "m", "messages": [{"role": "user", "content": "3+3?"}],
                                     "max_tokens": 4}}, _ChatTokenizer(), 64, DEFAULTS)
    assert pat.input.prompt == [ord(c) for c in "<user>2+2?<assistant>"]
    for item in (pat, openai):
        scorer.finished(item, [out([5])])
    scorer.finish()
    scorer.close()
    assert sorted(seen) == ["<user>2+2?<assistant>", "<user>3+3?<assistant>"]


def test_reward_flags_are_checked_before_any_engine_starts(tmp_path, capsys):
    base = ["batch", "--model", str(tmp_path), "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o")]
    assert main(base + ["--reward-workers", "4"]) == 1
    assert "--reward-workers and --reward-timeout need --reward" in capsys.readouterr().err
    assert main(base + ["--reward", "no_such_reward_module_q:score"]) == 1
    assert "cannot import 'no_such_reward_module_q'" in capsys.readouterr().err
    assert main(base + ["--reward", "/bin/true", "--reward-workers", "0"]) == 1
    assert "max_workers must be at least 1" in capsys.readouterr().err


# ---- the real command ------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_command_scores_every_answer_and_a_failed_reward_is_a_line_error(tmp_path, model_dir):
    model = model_dir("llama")
    verifier = tmp_path / "verify.py"
    verifier.write_text(VERIFIER)
    rows = [
        {"id": "a", "input_ids": [5, 6, 7], "max_tokens": 12, "metadata": {"bonus": 10}},
        {"id": "b", "prompt": "the answer is", "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 3},
        {"id": "crash", "input_ids": [9, 10], "max_tokens": 4, "metadata": {"crash": True}},
        {"id": "hang", "input_ids": [11, 12], "max_tokens": 4, "metadata": {"hang": True}},
        {"custom_id": "oa", "method": "POST", "url": "/v1/completions", "metadata": {"bonus": 100},
         "body": {"prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0, "return_token_ids": True}},
        '{"id": "broken", ',
    ]
    inp, res = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    t = time.perf_counter()
    r = run_cli("batch", "--model", model, "--input", inp, "--output", res, "--dtype", "float64",
                "--max-model-len", 128, "--reward", f"{sys.executable} {verifier}", "--reward-workers", 3,
                "--reward-timeout", 4, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert time.perf_counter() - t < 60  # the hung verifier was cut at its limit
    recs = {rec.get("custom_id") or rec["id"]: rec for rec in read_jsonl(res)}
    assert sorted(recs) == ["a", "b", "crash", "hang", "line-6", "oa"]  # every line, once
    assert recs["a"]["error"] is None and recs["a"]["reward"] == expected(recs["a"]["token_ids"], {"bonus": 10})
    assert recs["a"]["reward_info"] == {"prompt_kind": "list", "finish": recs["a"]["finish_reason"]}
    b = recs["b"]["samples"]
    assert [s["reward"] for s in b] == [expected(s["token_ids"], {}) for s in b]
    assert b[0]["reward_info"]["prompt_kind"] == "str"  # a text line's verifier gets its text
    assert recs["crash"]["error"].startswith("line 3: reward of answer 0 failed: crashed: RuntimeError: exit code 1")
    assert "sandbox crashed" in recs["crash"]["error"] and len(recs["crash"]["token_ids"]) == 4
    assert recs["hang"]["error"] == "line 4: reward of answer 0 failed: timed out after 4.0 s"
    choice = recs["oa"]["response"]["body"]["choices"][0]
    assert recs["oa"]["error"] is None and recs["oa"]["rewards"] == [expected(choice["token_ids"], {"bonus": 100})]
    assert "rewards: 6 scored (2 failed)" in r.stdout


@pytest.mark.slow
def test_tail_batched_rounds_score_every_answer_with_its_own_reward(tmp_path, model_dir):
    """Deferred lines too: a resumed answer is scored whole, and each record's rewards follow its answers."""
    from pat_engine import Engine
    from pat_engine.serve.batch.job import BatchJob, run_batch
    from pat_engine.serve.batch.rounds import TailBatchPolicy

    rows = [{"id": f"q{i}", "input_ids": [5 + i, 6, 7], "max_tokens": 30 if i % 3 == 0 else 4, "n": 2,
             "ignore_eos": True, "temperature": 1.0, "seed": 100 + i, "metadata": {"bonus": i}} for i in range(1, 8)]
    inp, res = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    verifier = tmp_path / "verify.py"
    verifier.write_text(VERIFIER)
    reward = BatchReward(SubprocessReward((sys.executable, str(verifier))), RewardConfig(max_workers=4, timeout_s=20))
    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float64", max_model_len=128) as engine:
        summary = run_batch(engine, BatchJob(inp, res, "m", progress=False, tail_batching=TailBatchPolicy(2, 0.5),
                                             reward=reward))
    recs = {rec["id"]: rec for rec in read_jsonl(res)}
    assert sorted(recs) == [f"q{i}" for i in range(1, 8)] and summary.rounds.deferred >= 1
    for i in range(1, 8):
        rec = recs[f"q{i}"]
        assert rec["error"] is None and len(rec["samples"]) == 2
        assert all(len(s["token_ids"]) == rows[i - 1]["max_tokens"] for s in rec["samples"])  # scored whole
        assert [s["reward"] for s in rec["samples"]] == [expected(s["token_ids"], {"bonus": i}) for s in rec["samples"]]
    assert (summary.rewards.scored, summary.rewards.failed) == (14, 0)
    assert json.loads(json.dumps(summary.to_dict()))["rewards"]["scored"] == 14
