"""Multi-turn agent rollouts through both adapters: veRL's agent loop and OpenRLHF's agent executor.

veRL: its own ``AgentLoopWorker.generate_sequences`` runs ``ToolAgentLoop`` (``tool_agent``) against the
``pat`` replica through its ``LLMServerClient`` (the replica from ``LLMServerManager``, as in
test_verl_adapter.py), with a scripted function tool and tool parser (bench/agent_scripts.py: a tiny
random model writes no tool calls); tool answers are appended between turns by veRL's own token
builder. OpenRLHF: ``generate_responses`` on a ``create_pat_engines`` actor runs the
``agent_func_path`` executor: OpenRLHF's ``MultiTurnAgentExecutor`` where openrlhf is importable, else a
stand-in that follows its contract (see bench/agent_scripts.py; OpenRLHF is not installed here).

Checked, float64, DP2 engines: every model turn equals transformers' greedy continuation of its
context, token for token, and stops at its first stop token; every later turn's prefill reuses the KV
of all earlier turns (the engine's prefix-cache hits equal every full block of the turns before,
summed over turns and conversations); a later turn arriving at an idle engine after a mid-stage switch
joins the stage instead of switching back; veRL's partial rollout (abort, ``FullyAsyncLLMServerClient``
resubmits) in a later turn gives the uninterrupted trajectories, and so does OpenRLHF's
``pause_generation`` / ``resume_generation`` (its only interruption: vLLM's ``mode="keep"``).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("verl", reason="veRL is not installed (pip install --no-deps verl==0.9.1; see docs/integrations.md)")
ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'ray[default]==2.60.0'")

from omegaconf import OmegaConf, open_dict  # noqa: E402

from agent_scripts import OPENRLHF_AGENT, STOPS, TURNS, VERL_TOOLS, reusable, segments  # noqa: E402
from conftest import hf_greedy  # noqa: E402
from pat_integrations.openrlhf.factory import create_pat_engines  # noqa: E402
from pat_integrations.stage import StagePlan  # noqa: E402
from rl_helpers import VllmLikeSamplingParams, export_code_paths, restore_env  # noqa: E402
from test_verl_adapter import StandInGroup, _hold, _release, ppo_config  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerManager  # noqa: E402
from waiting import wait_for_async  # noqa: E402

pytestmark = pytest.mark.slow  # starts worker processes

BLOCK = 4  # KV block size: small, so that short turns fill blocks
QUESTIONS = ["the sum of two prime numbers", "compute a remainder", "one theorem and its proof"]


def agent_config(model: str, tool_file: str, temperature: float):
    config = ppo_config(model)
    rollout = config.actor_rollout_ref.rollout
    with open_dict(config):
        rollout.engine_kwargs["pat"] = {"dtype": "float64", "block_size": BLOCK, "kv_transfer": "migrate"}
        rollout.prompt_length, rollout.response_length = 64, 200
        rollout.multi_turn.enable = True
        rollout.multi_turn.format = "pat_scripted"
        rollout.multi_turn.max_assistant_turns = TURNS
        rollout.multi_turn.function_tool_path = tool_file
        rollout.agent.default_agent_loop = "tool_agent"
        rollout.temperature, rollout.top_p, rollout.top_k = temperature, 1.0, -1
        rollout.calculate_log_probs = True
        rollout.full_determinism = True  # request ids det-{priority}: a rerun draws the same seeds
    return config


@pytest.fixture(scope="module")
def setup(model_dir, tmp_path_factory):
    old = export_code_paths()
    ray.init(num_cpus=2, include_dashboard=False)
    files = tmp_path_factory.mktemp("agents")
    (files / "verl_tools.py").write_text(VERL_TOOLS)
    (files / "openrlhf_agent.py").write_text(OPENRLHF_AGENT)
    try:
        model = model_dir("llama")
        config = agent_config(model, str(files / "verl_tools.py"), temperature=0.0)
        manager = LLMServerManager.create(config=config, worker_group=StandInGroup(config))
        engines = create_pat_engines(
            num_engines=1, tensor_parallel_size=2, pretrain=model, seed=0, full_determinism=False,
            enable_prefix_caching=True, enforce_eager=True, max_model_len=512, pat_base_tp=1,
            agent_func_path=str(files / "openrlhf_agent.py"),
            pat_engine_kwargs={"dtype": "float64", "block_size": BLOCK, "kv_transfer": "migrate"})
        yield model, config, manager, engines[0], str(files / "verl_tools.py")
        ray.get(engines[0].shutdown.remote())
    finally:
        ray.shutdown()
        restore_env(old)


# ---- veRL ---------------------------------------------------------------------------------------

def run_agent_loop(config, client, questions=QUESTIONS) -> list[tuple[list[int], list[int], list[int]]]:
    """veRL's AgentLoopWorker on a batch of questions (one trajectory each); per trajectory its prompt
    ids, response ids (model and tool turns) and response mask."""
    n = len(questions)
    messages = np.empty(n, dtype=object)
    messages[:] = [[{"role": "user", "content": q}] for q in questions]
    batch = DataProto.from_dict(non_tensors={
        "raw_prompt": messages, "agent_name": np.array(["tool_agent"] * n, dtype=object),
        "priority": np.arange(n), "index": np.arange(n)})  # AgentLoopManager attaches priority
    out = asyncio.run(AgentLoopWorker(config, client).generate_sequences(batch))
    width = out.batch["prompts"].shape[1]
    trajectories = []
    for i in range(n):
        attention = out.batch["attention_mask"][i]
        prompt = out.batch["prompts"][i][attention[:width] == 1].tolist()
        length = int(attention[width:].sum())
        trajectories.append((prompt, out.batch["responses"][i][:length].tolist(),
                             out.batch["response_mask"][i][:length].tolist()))
    return trajectories


def server_of(manager):
    return manager.get_replicas()[0].servers[0]


class Recording:
    """veRL's client as the agent loop uses it, keeping each call: request id, prompt ids, the answer."""

    def __init__(self, client):
        self.client, self.calls = client, []

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def generate(self, request_id, **kwargs):
        out = await self.client.generate(request_id, **kwargs)
        self.calls.append((request_id, list(kwargs["prompt_ids"]), out))
        return out


def check_turns(model, calls) -> None:
    """Each call (a turn) equals transformers' greedy continuation of its prompt and ran to its first
    stop token; a later turn of a trajectory found every full block of the turns before it cached."""
    last: dict[str, int] = {}  # request id (one per trajectory) -> its previous turn's prompt + response
    for rid, prompt, out in calls:
        check_model_turn(model, prompt, out.token_ids)
        assert out.extra_fields["num_cached_tokens"] == (reusable(last[rid], BLOCK) if rid in last else 0)
        last[rid] = len(prompt) + len(out.token_ids)


def check_model_turn(model, context: list[int], turn: list[int]) -> None:
    assert turn == hf_greedy(model, context, len(turn))
    assert turn[-1] in STOPS and not set(turn[:-1]) & set(STOPS)  # it ran to its first stop token


def test_verl_tool_agent_turns_are_exact_and_reuse_earlier_turns(setup):
    from transformers import AutoTokenizer

    model, config, manager, _, _ = setup
    ray.get(server_of(manager).clear_kv_cache.remote())
    client = Recording(manager.get_client())
    trajectories = run_agent_loop(config, client)
    assert len(client.calls) == TURNS * len(QUESTIONS)
    check_turns(model, client.calls)
    tokenizer = AutoTokenizer.from_pretrained(model)
    for prompt, response, mask in trajectories:  # what veRL made of the turns: the model's and the tool's
        runs = segments(mask)
        assert [m for m, _, _ in runs] == [1, 0] * (TURNS - 1) + [1]
        for (_, s, e), (_, t0, t1) in zip(runs[::2], runs[1::2]):
            key = response[e - 1]  # the call the turn made; the tool's answer follows it
            assert f"value {key % 97} for key {key}" in tokenizer.decode(response[t0:t1])
        sent = {(tuple(p), tuple(out.token_ids)) for _, p, out in client.calls}
        assert all((tuple(prompt + response[:s]), tuple(response[s:e])) in sent for _, s, e in runs[::2])


def test_a_later_turn_after_a_switch_joins_the_stage_and_keeps_its_cache(setup):
    """One trajectory; the stage switches TP1xDP2 -> TP2xDP1 during its first turn. Its later turns find
    the engine idle (the tool ran) but continue this stage's answers: no switch back, cache kept."""
    model, config, manager, _, _ = setup
    server = server_of(manager)
    ray.get(server.clear_kv_cache.remote())
    ray.get(server.__ray_call__.remote(lambda a: setattr(a.frontend, "plan", StagePlan.from_options([(2, 2)]))))
    client = Recording(manager.get_client())
    try:
        stages, switches = len(ray.get(server.stage_layouts.remote())), len(ray.get(server.switches.remote()))
        run_agent_loop(config, client, QUESTIONS[:1])
    finally:
        ray.get(server.__ray_call__.remote(lambda a: setattr(a.frontend, "plan", StagePlan())))
    assert len(client.calls) == TURNS and len(client.calls[0][2].token_ids) >= 4  # turn 1 outlives decode step 2
    check_turns(model, client.calls)
    assert len(ray.get(server.stage_layouts.remote())) == stages + 1  # one stage for the whole trajectory
    assert [(e["from_layout"], e["to_layout"]) for e in ray.get(server.switches.remote())[switches:]] \
        == [("TP1xDP2", "TP2xDP1")]


async def _abort_in_a_later_turn(server, first_turn_prompt: int) -> dict:
    """Hold the engine, look, and abort only when some request runs a later turn with tokens out
    (checked while held, so it cannot finish in between)."""
    while True:
        await _hold(server)
        running = await server.__ray_call__.remote(
            lambda a: [(r.prompt_len, r.generated) for r in a.engine.cluster_status().requests])
        if any(p > first_turn_prompt and g >= 2 for p, g in running):
            aborted = await server.abort_all_requests.remote()
            await _release(server)
            return aborted
        await _release(server)
        await asyncio.sleep(0.002)


def first_turn_length(tokenizer, questions=QUESTIONS, chat: bool = True) -> int:
    """The longest first-turn prompt: a longer one is a later turn."""
    def ids(q):
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False) if chat else q
        return tokenizer(text=text, add_special_tokens=False)["input_ids"]
    return max(len(ids(q)) for q in questions)


def test_verl_partial_rollout_in_a_later_turn_resumes_exactly(setup):
    from transformers import AutoTokenizer

    model, _, manager, _, tool_file = setup
    first = first_turn_length(AutoTokenizer.from_pretrained(model))
    config = agent_config(model, tool_file, temperature=1.0)
    lb = manager.global_load_balancer
    replica = manager.get_replicas()[0]
    server = replica.servers[0]

    async def interrupted():
        client = FullyAsyncLLMServerClient(config=config, load_balancer_handle=lb)
        run = asyncio.ensure_future(asyncio.to_thread(run_agent_loop, config, client))
        aborted = await _abort_in_a_later_turn(server, first)
        await asyncio.sleep(1.5)  # the client retries after 1 s: its resubmission waits at the closed gate
        await replica.resume_generation()
        return aborted, await run

    aborted, got = asyncio.run(interrupted())
    assert aborted["aborted_count"] >= 1
    want = run_agent_loop(config, FullyAsyncLLMServerClient(config=config, load_balancer_handle=lb))
    assert got == want
    assert all(sum(m for m, _, _ in segments(mask)) == TURNS for _, _, mask in got)


# ---- OpenRLHF -----------------------------------------------------------------------------------

def run_executor(engine, tokenizer, params, questions=QUESTIONS) -> list[dict]:
    refs = [engine.generate_responses.remote(prompt=q, label="", sampling_params=params, max_length=200,
                                             hf_tokenizer=tokenizer, num_samples=1) for q in questions]
    return [samples[0] for samples in ray.get(refs)]


def test_openrlhf_multi_turn_executor_turns_are_exact_and_reuse_earlier_turns(setup):
    from transformers import AutoTokenizer

    model, _, _, engine, _ = setup
    tokenizer = AutoTokenizer.from_pretrained(model)
    ray.get(engine.reset_prefix_cache.remote())
    before = ray.get(engine.prefix_cache_stats.remote())["hit_tokens"]
    params = VllmLikeSamplingParams(temperature=0.0, max_tokens=None, logprobs=1, stop_token_ids=STOPS)
    results = run_executor(engine, tokenizer, params)
    hits = 0
    for r in results:
        tokens, ranges = r["observation_tokens"], r["action_ranges"]
        assert len(ranges) == TURNS and len(r["rollout_log_probs"]) == len(tokens)
        for s, e in ranges:
            check_model_turn(model, tokens[:s], tokens[s:e])
        hits += sum(reusable(e, BLOCK) for _, e in ranges[:-1])
    assert ray.get(engine.prefix_cache_stats.remote())["hit_tokens"] - before == hits > 0


def test_openrlhf_pause_in_a_later_turn_resumes_exactly(setup):
    from transformers import AutoTokenizer

    model, _, _, engine, _ = setup
    tokenizer = AutoTokenizer.from_pretrained(model)
    params = VllmLikeSamplingParams(temperature=1.0, max_tokens=None, logprobs=1, stop_token_ids=STOPS, seed=5)
    want = run_executor(engine, tokenizer, params)
    first = first_turn_length(tokenizer, chat=False)

    async def paused():
        run = asyncio.ensure_future(asyncio.to_thread(run_executor, engine, tokenizer, params))
        while True:  # pause, look, resume: keep it paused once a later turn runs with tokens out
            await engine.pause_generation.remote()
            running = await engine.__ray_call__.remote(
                lambda a: [(r.prompt_len, r.generated) for r in a.engine.cluster_status().requests])
            if any(p > first and g >= 2 for p, g in running):
                break
            await engine.resume_generation.remote()
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.5)
        held = not run.done()
        await engine.resume_generation.remote()
        return held, await run

    held, got = asyncio.run(paused())
    assert held
    assert [r["observation_tokens"] for r in got] == [r["observation_tokens"] for r in want]
    for g, w in zip(got, want):
        assert g["rollout_log_probs"] == pytest.approx(w["rollout_log_probs"], abs=1e-9)
