"""The reward stage: streamed, bounded, and a timeout or a crash is that response's recorded failure; the
reward contract (reward_fns.py): what a reward receives and returns, commands and entry points."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest

from pat_engine.outputs import RequestOutput
from pat_engine.errors import InvalidRequestError
from pat_engine.rollout.reward_fns import RewardInput, reward_from_spec, reward_value
from pat_engine.rollout.rewards import AdaptiveTimeout, RewardConfig, RewardStage, SubprocessReward


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan waits for a reaper that a container may lack)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def response(text: str, prompt: tuple[int, ...] = (1, 2)) -> RequestOutput:
    return RequestOutput("r", list(prompt), [5, 6], text, "stop")


def test_results_stream_as_they_finish_and_a_slow_one_does_not_hold_the_rest():
    def score(item: RewardInput) -> float:
        time.sleep(float(item.response))
        return float(item.response)

    with RewardStage(score, RewardConfig(max_workers=3, timeout_s=10)) as stage:
        for key, delay in enumerate(["0.6", "0.0", "0.05"]):
            stage.submit(key, response(delay))
        order = [r.key for r in stage.results()]
    assert order[-1] == 0 and sorted(order) == [0, 1, 2]


def test_a_crash_and_a_hang_are_recorded_failures_and_the_stage_goes_on():
    def score(item: RewardInput) -> float:
        if item.response == "crash":
            raise ValueError("bad answer format")
        if item.response == "hang":
            threading.Event().wait()  # never returns
        return 1.0

    with RewardStage(score, RewardConfig(max_workers=2, timeout_s=0.3)) as stage:
        for key, text in enumerate(["crash", "hang", "ok", "ok"]):
            stage.submit(key, response(text))
        got = {r.key: r for r in stage.drain()}
    assert got[0].error == "crashed: ValueError: bad answer format" and got[0].reward is None
    assert got[1].timed_out and got[1].reward is None
    assert got[2].reward == got[3].reward == 1.0 and got[2].ok


def test_a_subprocess_reward_runs_and_is_killed_with_its_children_at_the_limit(tmp_path):
    script = tmp_path / "verify.py"
    script.write_text(
        "import json, os, subprocess, sys, time\n"
        "answer = json.load(sys.stdin)['response']\n"
        "if answer == 'loop':\n"
        f"    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"    open({str(tmp_path / 'child')!r}, 'w').write(str(child.pid))\n"
        "    time.sleep(60)\n"
        "if answer == 'fail':\n"
        "    sys.exit('wrong format')\n"
        "print(len(answer))\n")
    reward = SubprocessReward((sys.executable, str(script)))
    with RewardStage(reward, RewardConfig(max_workers=3, timeout_s=1.5)) as stage:
        for key, text in enumerate(["four", "loop", "fail"]):
            stage.submit(key, response(text))
        got = {r.key: r for r in stage.drain()}
    assert got[0].reward == 4.0
    assert got[1].timed_out and got[1].seconds < 5
    assert got[2].error.startswith("crashed: RuntimeError: exit code 1") and "wrong format" in got[2].error
    child = int((tmp_path / "child").read_text())
    time.sleep(0.2)
    assert not running(child)  # the sandbox's own child went with it


def test_an_async_reward_is_cancelled_at_its_limit():
    cancelled = threading.Event()

    async def judge(item: RewardInput) -> float:
        try:
            await asyncio.sleep(0.0 if item.response == "fast" else 30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 0.5

    with RewardStage(judge, RewardConfig(timeout_s=0.3)) as stage:
        stage.submit("a", response("fast"))
        stage.submit("b", response("slow"))
        got = {r.key: r for r in stage.drain()}
    assert got["a"].reward == 0.5 and got["b"].timed_out and cancelled.is_set()


def test_no_more_than_max_workers_run_at_once():
    running, peak, lock = [0], [0], threading.Lock()

    def score(item: RewardInput) -> float:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return 0.0

    with RewardStage(score, RewardConfig(max_workers=2, timeout_s=5)) as stage:
        for key in range(8):
            stage.submit(key, response("x"))
        assert len(stage.drain()) == 8
    assert peak[0] == 2


def test_the_adaptive_timeout_is_rollpackers_rule_per_task():
    t = AdaptiveTimeout(RewardConfig(t_min=2.0, t_max=30.0, factor=1.5))
    assert t.limit("case-1") == 30.0  # nothing succeeded yet
    t.observe("case-1", 0.4, 0.0)  # a failure does not anchor
    assert t.limit("case-1") == 30.0
    t.observe("case-1", 0.4, 1.0)
    assert t.limit("case-1") == 2.0  # 1.5 * 0.4 is below t_min
    t.observe("case-1", 8.0, 1.0)
    assert t.limit("case-1") == 12.0 and t.limit("case-2") == 30.0
    t.observe("case-1", 40.0, 1.0)
    assert t.limit("case-1") == 30.0
    assert AdaptiveTimeout(RewardConfig(timeout_s=3.0)).limit("any") == 3.0


def test_a_doomed_response_fails_fast_once_a_correct_one_is_known():
    def score(item: RewardInput) -> float:
        if item.response == "doomed":
            time.sleep(5)
        return 1.0

    cfg = RewardConfig(max_workers=1, t_min=0.2, t_max=4.0, factor=1.5)
    with RewardStage(score, cfg) as stage:
        stage.submit("good", response("good"))
        assert [r.reward for r in stage.drain()] == [1.0]
        stage.submit("doomed", response("doomed"))
        (result,) = stage.drain()
    assert result.timed_out and result.seconds < 1.0


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="max_workers"):
        RewardConfig(max_workers=0)
    with pytest.raises(ValueError, match="t_min"):
        RewardConfig(t_min=5, t_max=1)


# ---- the contract: what a reward receives and returns --------------------------------------------


def test_a_reward_returns_a_number_or_a_mapping_with_a_reward_and_anything_else_is_named():
    assert reward_value(1) == (1.0, {}) and reward_value(True) == (1.0, {})
    assert reward_value({"reward": 0.5, "passed": 3}) == (0.5, {"passed": 3})
    for bad, message in [("1.0", "expected a number"), ({"score": 1.0}, 'needs a "reward" entry'),
                         (float("nan"), "not finite"), (None, "expected a number")]:
        with pytest.raises(ValueError, match=message):
            reward_value(bad)


def test_the_prompt_and_its_metadata_reach_the_reward_and_a_bad_result_is_a_recorded_failure():
    seen = []

    def score(item: RewardInput):
        seen.append((item.prompt, item.response, item.output.token_ids, dict(item.metadata)))
        return {"reward": 2.0, "why": "ok"} if item.metadata["ok"] else "yes"

    with RewardStage(score, RewardConfig(timeout_s=5)) as stage:
        stage.submit("a", response("hi"), prompt="Q: 1+1?", metadata={"ok": True})
        stage.submit("b", response("no"), metadata={"ok": False})  # prompt defaults to the output's token ids
        got = {r.key: r for r in stage.drain()}
    assert (got["a"].reward, got["a"].info) == (2.0, {"why": "ok"})
    assert got["b"].reward is None and got["b"].error.startswith("bad result: expected a number")
    assert sorted(seen, key=repr) == [("Q: 1+1?", "hi", [5, 6], {"ok": True}), ([1, 2], "no", [5, 6], {"ok": False})]


def test_a_verifier_command_reads_the_documented_json_and_may_print_a_json_object(tmp_path):
    script = tmp_path / "verify.py"
    script.write_text(
        "import json, sys\n"
        "item = json.load(sys.stdin)\n"
        "print('log line first')\n"
        "if item['response'] == 'garbage':\n"
        "    print('not a reward')\n"
        "else:\n"
        "    print(json.dumps({'reward': len(item['token_ids']), 'echo': [item['prompt'], item['finish_reason'],\n"
        "                      item['metadata']]}))\n")
    reward = SubprocessReward((sys.executable, str(script)))
    with RewardStage(reward, RewardConfig(timeout_s=20)) as stage:
        stage.submit(0, response("fine"), prompt="the prompt", metadata={"answer": 42})
        stage.submit(1, response("garbage"))
        got = {r.key: r for r in stage.drain()}
    assert got[0].reward == 2.0 and got[0].info == {"echo": ["the prompt", "stop", {"answer": 42}]}
    assert got[1].error == "bad result: its last stdout line is not a number or a JSON object: 'not a reward'"


def test_closing_the_stage_kills_a_running_verifier_and_abandons_a_hung_callable(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text(f"import os, time\nopen({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\n"
                      "time.sleep(60)\nprint(1)\n")
    for fn in (SubprocessReward((sys.executable, str(script))), lambda item: threading.Event().wait()):
        stage = RewardStage(fn, RewardConfig(timeout_s=60))
        stage.submit(0, response("x"))
        time.sleep(0.5)
        t = time.perf_counter()
        stage.close()
        assert time.perf_counter() - t < 3  # not the 60 s limit
    time.sleep(0.2)
    assert not running(int((tmp_path / "pid").read_text()))


def test_reward_specs_are_an_entry_point_or_a_command_and_bad_ones_are_named(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text("def score(item):\n    return len(item.response)\nNOT_A_FN = 3\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = reward_from_spec("my_reward:score")
    assert fn(RewardInput("p", "four", response("four"))) == 4
    assert reward_from_spec(f"{sys.executable} -c 'print(1)'") == SubprocessReward((sys.executable, "-c", "print(1)"))
    for spec, message in [("no_such_module_xyz:score", "cannot import 'no_such_module_xyz'"),
                          ("my_reward:missing", "has no 'missing'"), ("my_reward:NOT_A_FN", "is not callable"),
                          ("no-such-verifier --x", "'no-such-verifier' is not an executable"),
                          ("python 'unclosed", "No closing quotation"), ("  ", "the reward is empty")]:
        with pytest.raises(InvalidRequestError, match=message):
            reward_from_spec(spec)


def test_a_verifier_that_prints_megabytes_is_read_through_a_bounded_tail(tmp_path):
    """Model-written code may print without end: the verifier's output is kept as its last TAIL_BYTES only,
    and its result (the last line) still comes through; stdin need not be read at all."""
    from pat_engine.rollout import reward_fns

    script = tmp_path / "noisy.py"
    script.write_text("import sys\nfor _ in range(64):\n    sys.stdout.write('x' * 65536 + '\\n')\nprint(0.25)\n")
    reward = SubprocessReward((sys.executable, str(script)))
    assert reward.run(RewardInput([1, 2], "ignored", response("ignored")), 30.0, threading.Event()) == 0.25
    r, w = __import__("os").pipe()
    tail = reward_fns._Tail(open(r, "rb"))
    with open(w, "wb") as sink:
        for i in range(40):
            sink.write(bytes([65 + i % 26]) * 65536)
    tail.join(5)
    assert len(tail.kept) == reward_fns.TAIL_BYTES and tail.kept == bytes([65 + 39 % 26]) * reward_fns.TAIL_BYTES
