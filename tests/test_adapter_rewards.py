"""Rewards in the adapters' ``rollout_step``, passed the way each framework passes them: veRL's
``custom_reward_function`` / ``compute_score``, OpenRLHF's ``remote_rm_url`` (a ``reward_func`` file or a
reward-model server). The conventions first (no engine), then each adapter's ``rollout_step`` on a real
engine, the actor called in-process (Ray only carries the call)."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import pytest

from pat_engine.outputs import RequestOutput
from pat_engine.rollout.reward_fns import RewardInput, call_reward
from pat_integrations.reward_conventions import openrlhf_reward, verl_reward
from pat_integrations.rollout_options import reward_config
from rl_helpers import VllmLikeSamplingParams

GSM8K = {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "42"}, "extra_info": {"split": "train"}}


def item(response: str, metadata: dict, prompt="Q", prompt_ids=(1, 2), token_ids=(5, 6)) -> RewardInput:
    return RewardInput(prompt, response, RequestOutput("r", list(prompt_ids), list(token_ids), response, "stop"),
                       metadata)


def score(fn, it: RewardInput) -> tuple[float, dict]:
    return call_reward(fn, it, 10.0, threading.Event())


class WordTokenizer:
    """Decodes ids as words, so the texts a reward gets can be told apart exactly."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids) + ("" if skip_special_tokens else " </s>")


# ---- veRL ------------------------------------------------------------------------------------------------


@pytest.mark.slow  # imports veRL's reward stack (3 s)
def test_verl_default_compute_score_and_a_custom_reward_function_file(tmp_path):
    pytest.importorskip("verl")
    default = verl_reward({"path": None})
    assert score(default, item("so the answer is #### 42", GSM8K)) == (1.0, {})
    assert score(default, item("#### 41", GSM8K)) == (0.0, {})
    (tmp_path / "my_reward.py").write_text(
        "def my_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
        "    ok = solution_str.strip().endswith(ground_truth)\n"
        "    return {'score': scale * ok, 'acc': ok, 'split': extra_info['split'], 'source': data_source}\n")
    spec = {"path": str(tmp_path / "my_reward.py"), "name": "my_score", "reward_kwargs": {"scale": 2.0}}
    fn = verl_reward(spec)
    assert verl_reward(dict(spec)) is fn  # the same spec every step: the same reward, the stage is kept
    from omegaconf import OmegaConf

    assert verl_reward(OmegaConf.create(spec)) is fn  # config.reward.custom_reward_function as Hydra gives it
    assert score(fn, item("it is 42", GSM8K)) == (2.0, {"acc": True, "split": "train", "source": "openai/gsm8k"})


def test_verl_async_compute_score_and_errors_that_name_the_problem():
    async def judge(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(0)
        return float(len(solution_str))

    assert score(verl_reward(judge), item("abc", GSM8K)) == (3.0, {})
    with pytest.raises(ValueError, match="needs the prompt's data_source"):
        score(verl_reward(judge), item("abc", {}))
    with pytest.raises(ValueError, match=r"unknown custom_reward_function key\(s\) \['fn'\]"):
        verl_reward({"path": "x.py", "fn": "f"})
    with pytest.raises(ValueError, match="custom_reward_function"):
        verl_reward(3)


# ---- OpenRLHF --------------------------------------------------------------------------------------------


def test_openrlhf_reward_func_file_gets_query_prompt_and_label(tmp_path):
    pytest.importorskip("torch")  # the reward file builds torch tensors
    path = tmp_path / "reward_func.py"
    path.write_text(
        "import torch\n"
        "def reward_func(queries, prompts, labels, **kwargs):\n"
        "    assert len(queries) == len(prompts) == len(labels) == 1\n"
        "    r = torch.tensor([float(queries[0].startswith(prompts[0]) and labels[0] in queries[0])])\n"
        "    return {'rewards': r, 'scores': r, 'extra_logs': {'seen': torch.tensor([len(queries[0])])}}\n")
    fn = openrlhf_reward(str(path), WordTokenizer())
    query = "w1 w2 w5 w6 </s>"
    assert score(fn, item("", {"label": "w6"}, prompt="w1 w2")) == (1.0, {"scores": 1.0,
                                                                           "extra_logs": {"seen": len(query)}})
    assert score(fn, item("", {"label": "w9"}, prompt=[1, 2]))[0] == 0.0  # token-id prompt: decoded


def test_openrlhf_reward_model_servers_take_the_responses_in_turn():
    bodies, lock = [], threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                bodies.append((self.server.server_port, body))
            reply = json.dumps({"rewards": [len(body["labels"][0])], "scores": [0.5]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    servers = [HTTPServer(("127.0.0.1", 0), Handler) for _ in range(2)]
    for srv in servers:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        fn = openrlhf_reward([f"http://127.0.0.1:{s.server_port}/get_reward" for s in servers], WordTokenizer())
        got = [score(fn, item("", {"label": "x" * k}, prompt="w1 w2")) for k in (1, 2, 3)]
    finally:
        for srv in servers:
            srv.shutdown()
    assert got == [(1.0, {"scores": 0.5}), (2.0, {"scores": 0.5}), (3.0, {"scores": 0.5})]
    ports = [s.server_port for s in servers]
    assert [port for port, _ in bodies] == [ports[0], ports[1], ports[0]]
    assert bodies[0][1] == {"query": ["w1 w2 w5 w6 </s>"], "prompts": ["w1 w2"], "labels": ["x"]}


def test_reward_options_are_checked_by_name():
    assert reward_config(None).max_workers == 4 and reward_config({"max_workers": 16}).max_workers == 16
    with pytest.raises(ValueError, match=r"unknown reward_options option\(s\) \['workers'\]"):
        reward_config({"workers": 2})
    with pytest.raises(ValueError, match="reward_options: max_workers must be at least 1"):
        reward_config({"max_workers": 0})


# ---- the adapters' rollout_step on a real engine ---------------------------------------------------------

PROMPT_IDS = [[5, 6, 7], [100, 20, 30], [9, 10, 11, 12], [40, 41], [3, 4, 5, 6, 7], [60, 61, 62]]


def check_rewards(result, expected_of) -> int:
    """Every returned response has its own reward, in the groups' order; returns how many."""
    assert [len(r) for r in result.rewards] == [len(outs) for _, outs in result.groups]
    n = 0
    for (uid, outs), rewards in zip(result.groups, result.rewards):
        for o, r in zip(outs, rewards):
            assert r.ok, r.error
            assert r.reward == expected_of(uid, o)
            n += 1
    return n


@pytest.mark.slow
def test_openrlhf_rollout_step_scores_with_remote_rm_url(model_dir, tmp_path):
    from transformers import AutoTokenizer

    from pat_integrations.openrlhf.actor import PatRolloutActor

    path = tmp_path / "reward_func.py"
    path.write_text("import torch\n"
                    "def reward_func(queries, prompts, labels):\n"
                    "    return torch.tensor([len(queries[0]) * 10.0 + int(labels[0])])\n")
    model = model_dir("llama")
    tok = AutoTokenizer.from_pretrained(model)
    actor = PatRolloutActor(model=model, tensor_parallel_size=2, pat_base_tp=1, seed=0, max_model_len=256,
                            remote_rm_url=str(path), pat_engine_kwargs={"dtype": "float64"},
                            pat_rollout={"responses_per_step": 4, "group_size": 2, "tail_batching": {"eta": 0.5}})
    params = VllmLikeSamplingParams(temperature=1.0, max_tokens=12, seed=5, logprobs=1)
    labels = {f"u{i}": i for i in range(len(PROMPT_IDS))}

    def expected(uid, o):
        c = o.outputs[0]
        return len(tok.decode(o.prompt_token_ids + c.token_ids, skip_special_tokens=False)) * 10.0 + labels[uid]

    try:
        prompts = [(f"u{i}", ids, labels[f"u{i}"]) for i, ids in enumerate(PROMPT_IDS)]
        stages = []
        for k in (0, 3):  # two rounds of 2 prompts x 2 responses
            assert check_rewards(asyncio.run(actor.rollout_step(prompts[k:k + 3], params)), expected) == 4
            stages.append(actor.rounds._rewards)
        assert stages[0] is stages[1] is not None  # one stage across steps: the adaptive timeouts carry over
    finally:
        actor.shutdown()


@pytest.mark.slow
def test_verl_rollout_step_scores_with_a_custom_reward_function(model_dir, tmp_path):
    pytest.importorskip("verl")
    from test_verl_adapter import ppo_config
    from verl.workers.rollout.replica import RolloutMode

    from pat_integrations.verl.server import PatServer

    (tmp_path / "rf.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
        "    return {'score': scale * (len(solution_str) + int(ground_truth)), 'source': data_source}\n")
    model = model_dir("llama")
    config = ppo_config(model)
    server = PatServer(config.actor_rollout_ref.rollout, SimpleNamespace(path=model), RolloutMode.STANDALONE, 0, 2)
    truths = {f"u{i}": str(i) for i in range(len(PROMPT_IDS))}
    spec = {"path": str(tmp_path / "rf.py"), "name": "compute_score", "reward_kwargs": {"scale": 3.0}}
    params = {"temperature": 1.0, "max_tokens": 12, "logprobs": True}

    def expected(uid, o):
        return 3.0 * (len(server.engine.tokenizer.decode(o.token_ids, skip_special_tokens=True)) + int(truths[uid]))

    try:
        prompts = [(f"u{i}", ids, {"data_source": "toy", "reward_model": {"ground_truth": truths[f"u{i}"]}})
                   for i, ids in enumerate(PROMPT_IDS)]
        results = [asyncio.run(server.rollout_step(prompts[k:k + 3], params, reward=spec)) for k in (0, 3)]
        assert sum(check_rewards(r, expected) for r in results) == 8
        assert all(r.info == {"source": "toy"} for res in results for g in res.rewards for r in g)
    finally:
        server.shutdown()
