"""pat-engine as veRL's rollout backend ``pat``, driven by veRL's own classes on CPU with Ray.

The replica comes from veRL's registry (``LLMServerManager`` with
``rollout.name=pat`` from the real ``ppo_trainer`` Hydra config), generation
goes through veRL's ``LLMServerClient`` and load balancer, and weights go
through veRL's ``CheckpointEngineManager`` (naive backend) and
``ActorRolloutRefWorker.update_weights`` on two stand-in trainer ranks (see
``verl_trainer_standin.py``). The engine is TP1xDP2 and switches to TP2xDP1
mid-stage on a schedule; every stage starts again from TP1xDP2.

Tail batching (``engine_kwargs.pat.tail_batching`` / ``responses_per_step`` / ``group_size``) runs
through the replica's server actor (``PatServer.rollout_step``) and veRL's checkpoint manager for
the weight sync that makes deferred partials stale; veRL's own partial rollout (abort, then
``FullyAsyncLLMServerClient`` resubmitting prompt + tokens so far) runs through the real client.
Neither needs a stand-in; veRL's trainer loop itself (FSDP workers on GPUs, TransferQueue for the
v1 trainer) does not run here, so no test drives ``rollout_step`` from a trainer.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="veRL is not installed (pip install --no-deps verl==0.9.1; see docs/integrations.md)")
ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'ray[default]==2.60.0'")

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import open_dict  # noqa: E402

import verl  # noqa: E402
from conftest import MAX_NEW, PROMPTS, hf_greedy_batch  # noqa: E402
from rl_helpers import CODE_PATHS, export_code_paths, perturbed_checkpoint, restore_env  # noqa: E402
from verl_trainer_standin import HybridWorkerStandIn  # noqa: E402
from waiting import wait_for_async  # noqa: E402

import pat_integrations.verl.plugin  # noqa: E402,F401  (registers "pat" in this process)
from pat_integrations.verl.adapter import PatServerAdapter  # noqa: E402
from pat_integrations.verl.replica import PatReplica  # noqa: E402
from verl.checkpoint_engine.base import CheckpointEngineManager  # noqa: E402
from verl.workers.config.rollout import CheckpointEngineConfig  # noqa: E402
from verl.workers.rollout.base import get_rollout_class  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerManager  # noqa: E402
from verl.workers.rollout.replica import get_rollout_replica_class  # noqa: E402

pytestmark = pytest.mark.slow  # starts worker processes

GREEDY = {"temperature": 0, "top_p": 1.0, "top_k": -1, "logprobs": True, "repetition_penalty": 1.0}


def ppo_config(model: str):
    cfg_dir = os.path.join(os.path.dirname(verl.__file__), "trainer/config")
    with initialize_config_dir(config_dir=cfg_dir, version_base=None):
        config = compose(config_name="ppo_trainer")
    rollout = config.actor_rollout_ref.rollout
    with open_dict(config):  # the config lines docs/integrations.md gives for a GRPO run
        rollout.name = "pat"
        rollout.tensor_model_parallel_size = 1
        rollout.data_parallel_size = 2
        rollout.n_gpus_per_node = 2
        rollout.prompt_length = 32
        rollout.response_length = 480
        rollout.engine_kwargs["pat"] = {"dtype": "float64", "switch_schedule": [[4, 2]],
                                         "tail_batching": {"eta": 0.5}, "responses_per_step": 4, "group_size": 2}
        config.actor_rollout_ref.model.path = model
    return config


class StandInGroup:
    """The trainer worker group as veRL's managers see it: workers, world size, update_weights."""

    def __init__(self, config):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cls = ray.remote(num_cpus=0)(HybridWorkerStandIn)
        self.workers = [cls.remote(rank, 2, port, config.actor_rollout_ref) for rank in range(2)]
        self.world_size = 2

    def set_weights(self, path: str) -> None:
        ray.get([w.set_weights.remote(str(Path(path) / "model.safetensors")) for w in self.workers])

    def update_weights(self, **kwargs):
        return [w.update_weights.remote(**kwargs) for w in self.workers]


@pytest.fixture(scope="module")
def rollout(model_dir, tmp_path_factory):
    old = export_code_paths()
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        config = ppo_config(model_dir("llama"))
        group = StandInGroup(config)
        manager = LLMServerManager.create(config=config, worker_group=group)
        checkpoints = CheckpointEngineManager(CheckpointEngineConfig(backend="naive"), group, manager.get_replicas())
        root = tmp_path_factory.mktemp("verl_steps")
        steps = [perturbed_checkpoint(model_dir("llama"), root / f"step{i}", seed=10 + i) for i in (1, 2)]
        yield SimpleNamespace(config=config, group=group, manager=manager, checkpoints=checkpoints, steps=steps)
    finally:
        ray.shutdown()
        restore_env(old)


def generate_all(client, params=GREEDY, prompts=PROMPTS, max_new=MAX_NEW):
    async def go():
        return await asyncio.gather(*[
            client.generate(f"req-{i}", prompt_ids=p, sampling_params={**params, "max_tokens": m})
            for i, (p, m) in enumerate(zip(prompts, max_new))
        ])
    return asyncio.run(go())


def test_pat_is_in_both_registries(rollout):
    assert get_rollout_replica_class("pat") is PatReplica
    assert get_rollout_class("pat", "async") is PatServerAdapter
    assert ray.get(rollout.group.workers[0].rollout_class.remote()) == "PatServerAdapter"
    assert rollout.manager.get_addresses() == [f"pat://{ray.util.get_node_ip_address()}/replica-0"]


def test_plugin_registers_when_verl_imports_it():
    """veRL imports external modules while ``import verl`` runs: registration must work from there."""
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "pat_integrations.verl.plugin",
           "PYTHONPATH": os.pathsep.join(CODE_PATHS)}
    code = ("import verl; from verl.workers.rollout.replica import RolloutReplicaRegistry as R;"
            "from verl.workers.rollout.base import _ROLLOUT_REGISTRY as B;"
            "print(R.get('pat').__name__, B[('pat', 'async')])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["PatReplica", "pat_integrations.verl.adapter.PatServerAdapter"]


def _set_weight_transfer(worker, how: str, mesh: bool) -> None:
    """Run in each stand-in trainer rank (both at once: building the mesh is collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    worker.rollout.weight_transfer = how
    if not mesh:
        worker.rollout.device_mesh = None
    elif worker.rollout.device_mesh is None:  # veRL's rollout mesh: (dp, infer_tp, infer_pp) = (1, 2, 1)
        worker.rollout.device_mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("dp", "infer_tp", "infer_pp"))


# (weights, weight_transfer, infer_tp mesh): by handle from the talking rank alone (CPU tensors, no mesh),
# by value through Ray's object store, then by handle from both ranks, one payload per engine worker
SYNCS = ((0, "auto", False), (1, "object_store", False), (0, "auto", True), (1, "handles", True))


def test_training_steps_sync_weights_and_generate_token_exact(rollout):
    server = rollout.manager.get_replicas()[0].servers[0]
    client = rollout.manager.get_client()
    for step, (which, how, mesh) in enumerate(SYNCS, start=1):
        path = rollout.steps[which]
        ray.get([w.__ray_call__.remote(_set_weight_transfer, how, mesh) for w in rollout.group.workers])
        counts = ray.get(server.weight_bucket_counts.remote())
        # the trainer's loop: rollout asleep during training, then the weight sync wakes it
        rollout.checkpoints.sleep_replicas()
        rollout.group.set_weights(path)
        rollout.checkpoints.update_weights(global_steps=step)
        now = ray.get(server.weight_bucket_counts.remote())
        moved = "values" if how == "object_store" else "handles"
        assert now[moved] > counts[moved] and all(now[k] == counts[k] for k in now if k != moved)
        outs = generate_all(client)
        assert [o.token_ids for o in outs] == hf_greedy_batch(path)
        assert all(o.stop_reason == "completed" and len(o.log_probs) == len(o.token_ids) for o in outs)
        assert all(o.extra_fields["global_steps"] == step for o in outs)
        switches = ray.get(server.switches.remote())
        assert switches[-1]["to_layout"] == "TP2xDP1" and switches[-1]["ok"]
    ray.get([w.__ray_call__.remote(_set_weight_transfer, "auto", False) for w in rollout.group.workers])
    # the last weights arrived while the engine sat in TP2xDP1; its stage still began at the base layout
    assert ray.get(server.stage_layouts.remote())[-2:] == ["TP1xDP2", "TP1xDP2"]


async def _running_with_tokens(server, count: int, at_least: int) -> bool:
    """Whether ``count`` requests run on the server's engine, each with ``at_least`` tokens."""
    counts = await server.__ray_call__.remote(
        lambda actor: [r.generated for r in actor.engine.cluster_status().requests])
    return len(counts) >= count and all(n >= at_least for n in counts)


async def _hold(server) -> None:
    """Pause the server's engine in place: its running requests keep their KV and stop stepping."""
    await server.__ray_call__.remote(lambda actor: actor.engine.pause("in_place"))


async def _release(server) -> None:
    await server.__ray_call__.remote(lambda actor: actor.engine.resume())


def test_abort_all_requests_and_resume_generation(rollout):
    replica = rollout.manager.get_replicas()[0]
    server = replica.servers[0]
    client = rollout.manager.get_client()
    long = {**GREEDY, "ignore_eos": True}

    async def go():
        running = [asyncio.ensure_future(client.generate(f"long-{i}", prompt_ids=PROMPTS[i],
                                                         sampling_params={**long, "max_tokens": 400}))
                   for i in range(2)]
        await wait_for_async(lambda: _running_with_tokens(server, 2, 5))
        await _hold(server)  # running, tokens produced, now held: the abort cannot find them finished
        result = await server.abort_all_requests.remote()
        await _release(server)
        aborted = await asyncio.gather(*running)
        # while the gate is closed a new request waits; resume_generation lets it through
        late = asyncio.ensure_future(client.generate("late", prompt_ids=PROMPTS[2],
                                                     sampling_params={**GREEDY, "max_tokens": MAX_NEW[2]}))
        await asyncio.sleep(1.0)
        held = not late.done()
        await replica.resume_generation()
        return result, aborted, held, await late

    result, aborted, held, late = asyncio.run(go())
    assert result["aborted_count"] == 2
    for out in aborted:
        assert out.stop_reason == "aborted" and 0 < len(out.token_ids) < 400
    assert held and late.stop_reason == "completed" and late.token_ids == hf_greedy_batch(rollout.steps[-1])[2]


def test_adapter_release_and_resume_drive_sleep_and_wake(rollout):
    """The trainer-side adapter's release()/resume(tags), as veRL's hybrid worker calls them."""
    server = rollout.manager.get_replicas()[0].servers[0]
    trainer = rollout.group.workers[0]  # rollout rank 0: the one that talks to the server
    client = rollout.manager.get_client()
    ray.get(trainer.release_rollout.remote())
    assert ray.get(server.is_sleeping.remote())
    ray.get(trainer.resume_rollout.remote(["weights"]))
    assert ray.get(server.is_sleeping.remote())  # the KV cache is still released
    ray.get(trainer.resume_rollout.remote(["kv_cache"]))
    assert not ray.get(server.is_sleeping.remote())
    # hybrid sleep is level 2: the synced weights were dropped, so generation waits for the next sync
    with pytest.raises(Exception, match="not current"):
        generate_all(client, prompts=PROMPTS[:1], max_new=MAX_NEW[:1])
    rollout.checkpoints.update_weights(global_steps=3)
    assert [o.token_ids for o in generate_all(client)] == hf_greedy_batch(rollout.steps[-1])


# ---- sampling options through veRL's client (issue 20 item 5) ------------------------------------

_ids = iter(range(10**6))


def run_one(client, params, prompt=PROMPTS[1]):
    return asyncio.run(client.generate(f"opt-{next(_ids)}", prompt_ids=prompt, sampling_params=dict(params)))


def ascii_stop(text: str) -> str:
    """Two printable ASCII characters from the middle of ``text`` (a stop string the decoded text really has)."""
    for i in range(len(text) // 3, len(text) - 1):
        if text[i:i + 2].isascii() and text[i:i + 2].isprintable() and text[i:i + 2].strip():
            return text[i:i + 2]
    raise AssertionError(f"no ASCII pair in {text!r}")


def test_penalties_min_p_and_logit_bias_take_effect(rollout):
    client = rollout.manager.get_client()
    base = {**GREEDY, "max_tokens": 40, "ignore_eos": True}
    plain = run_one(client, base).token_ids
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        assert run_one(client, {**base, name: 1.5}).token_ids != plain, name
    assert run_one(client, {**base, "logit_bias": {7: 100.0}}).token_ids == [7] * 40
    sampled = {**base, "temperature": 1.0, "seed": 3}
    assert run_one(client, sampled).token_ids != plain
    assert run_one(client, {**sampled, "min_p": 1.0}).token_ids == plain  # only the most likely token is left


def test_n_samples_stop_strings_and_prompt_logprobs(rollout, model_dir):
    from transformers import AutoTokenizer

    client = rollout.manager.get_client()
    base = {**GREEDY, "max_tokens": 40, "ignore_eos": True}
    out = run_one(client, {**base, "temperature": 1.0, "seed": 5, "n": 3})
    samples = out.extra_fields["samples"]
    assert len(samples) == 3 and samples[0]["token_ids"] == out.token_ids and samples[0]["log_probs"] == out.log_probs
    assert len({tuple(s["token_ids"]) for s in samples}) == 3
    assert all(len(s["log_probs"]) == len(s["token_ids"]) == 40 for s in samples)

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    plain = run_one(client, base).token_ids
    stop = ascii_stop(tokenizer.decode(plain, skip_special_tokens=True))
    cut = run_one(client, {**base, "stop": [stop]}).token_ids
    assert len(cut) < len(plain) and plain[:len(cut)] == cut  # vLLM's ids: up to the token that completed it
    assert stop in tokenizer.decode(cut, skip_special_tokens=True)

    prompt = PROMPTS[3]
    teacher = {"max_tokens": 1, "temperature": 1.0, "detokenize": False}  # what veRL's distillation teacher sends
    top2 = run_one(client, {**teacher, "prompt_logprobs": 2}, prompt).extra_fields
    own = run_one(client, {**teacher, "prompt_logprobs": 0}, prompt).extra_fields
    assert len(top2["prompt_ids"]) == len(own["prompt_ids"]) == len(prompt)  # a row per token after the first + pad
    assert own["prompt_ids"][:-1] == [[t] for t in prompt[1:]]
    for (i1, i2), (a, b), (t,), (lp,) in zip(top2["prompt_ids"][:-1], top2["prompt_logprobs"][:-1],
                                           own["prompt_ids"][:-1], own["prompt_logprobs"][:-1]):
        assert 0 >= a >= b and lp <= a + 1e-12
        if t in (i1, i2):
            assert lp == pytest.approx(a if t == i1 else b)


def test_prefix_caching_switch_reaches_the_engine(model_dir):
    from pat_integrations.verl.settings import PatRolloutSettings

    config = ppo_config(model_dir("llama"))
    rollout_config, model_config = config.actor_rollout_ref.rollout, config.actor_rollout_ref.model
    assert PatRolloutSettings.from_verl(rollout_config, model_config, 2).engine_kwargs["enable_prefix_caching"]
    with open_dict(config):
        rollout_config.enable_prefix_caching = False
        rollout_config.repetition_penalty = 1.2
    settings = PatRolloutSettings.from_verl(rollout_config, model_config, 2)
    assert settings.engine_kwargs["enable_prefix_caching"] is False
    assert settings.sampling_defaults == {"repetition_penalty": 1.2, "ignore_eos": False}
    for flag in (True, False):  # vLLM's enforce_eager: no CUDA graphs
        with open_dict(config):
            rollout_config.enforce_eager = flag
        assert PatRolloutSettings.from_verl(rollout_config, model_config, 2).engine_kwargs["enforce_eager"] is flag


# ---- tail batching and partial rollout (issue 25 item 2) ------------------------------------------

STOP_SOME = list(range(0, 390, 5))  # a fifth of the vocabulary ends a response: lengths vary per seed
TB_PARAMS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True, "max_tokens": 40, "seed": 77,
             "stop_token_ids": STOP_SOME}


def reference(client, prompt, uid, r, params=TB_PARAMS):
    """The response r of prompt uid, uninterrupted: the same request with the seed the round gave it."""
    from pat_engine.rollout.runner import derived_seed

    seeded = {**params, "seed": derived_seed(params["seed"], uid, r)}
    return asyncio.run(client.generate(f"ref-{uid}-{r}-{next(_ids)}", prompt_ids=prompt, sampling_params=seeded))


def check_exact(client, result, prompts):
    for uid, outs in result.groups:
        assert len(outs) == 2
        for out in outs:  # in finish order; the index within the prompt picks the seed
            ref = reference(client, prompts[uid], uid, out.extra_fields["sample_index"])
            assert out.token_ids == ref.token_ids and out.stop_reason == "completed"
            assert out.log_probs == pytest.approx(ref.log_probs, abs=1e-9)


def test_tail_batched_steps_defer_and_resume_exactly(rollout):
    """Two short rounds (3 prompts x 3 responses, the first 2 prompts with 2 finished responses
    return), then the long round of the 2 deferred prompts: each returned response equals the same
    request run alone, the resumed ones included."""
    server = rollout.manager.get_replicas()[0].servers[0]
    client = rollout.manager.get_client()
    prompts = {f"p{i}": p for i, p in enumerate(PROMPTS)}
    uids = list(prompts)
    s0 = ray.get(server.rollout_step.remote([(u, prompts[u]) for u in uids[:3]], TB_PARAMS))
    assert s0.kind == "short" and len(s0.groups) == 2 and s0.prompts_deferred == 1 and s0.queued == 1
    check_exact(client, s0, prompts)
    s1 = ray.get(server.rollout_step.remote([(u, prompts[u]) for u in uids[3:6]], TB_PARAMS))
    assert s1.kind == "short" and s1.queued == 2 and s1.wants == 3
    s2 = ray.get(server.rollout_step.remote([], TB_PARAMS))  # the queue holds P0 prompts: a long round
    assert s2.kind == "long" and s2.queued == 0 and s2.stale_regenerated == 0 and s2.resumed >= 1
    assert {u for u, _ in s2.groups} == set(uids) - {u for s in (s0, s1) for u, _ in s.groups}
    check_exact(client, s2, prompts)


def test_a_weight_sync_makes_deferred_partials_stale(rollout):
    server = rollout.manager.get_replicas()[0].servers[0]
    client = rollout.manager.get_client()
    prompts = {f"q{i}": p for i, p in enumerate(PROMPTS)}
    uids = list(prompts)
    ray.get(server.rollout_step.remote([(u, prompts[u]) for u in uids[:3]], TB_PARAMS))
    ray.get(server.rollout_step.remote([(u, prompts[u]) for u in uids[3:6]], TB_PARAMS))
    rollout.checkpoints.update_weights(global_steps=4)  # veRL's weight sync (the same weights, a new version)
    s2 = ray.get(server.rollout_step.remote([], TB_PARAMS))
    assert s2.kind == "long" and s2.resumed == 0 and s2.stale_regenerated >= 1
    check_exact(client, s2, prompts)


def test_verl_partial_rollout_resumes_exactly(rollout):
    """veRL's partial rollout: abort_all_requests mid-generation, the FullyAsyncLLMServerClient waits
    and sends prompt + tokens so far after resume_generation; the server continues the request with
    the seed it pinned, so the whole response equals an uninterrupted run of the same request."""
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient

    config = OmegaConf.create(OmegaConf.to_container(rollout.config))
    config.actor_rollout_ref.rollout.full_determinism = True  # request ids pass through: the reference can reuse one
    lb = rollout.manager.global_load_balancer
    replica = rollout.manager.get_replicas()[0]
    server = replica.servers[0]
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True, "max_tokens": 300,
              "ignore_eos": True}  # no seed, as veRL's agent loop sends it

    async def interrupted():
        client = FullyAsyncLLMServerClient(config=config, load_balancer_handle=lb)
        task = asyncio.ensure_future(client.generate("partial-0", prompt_ids=PROMPTS[0], sampling_params=params))
        await wait_for_async(lambda: _running_with_tokens(server, 1, 5))
        await _hold(server)
        aborted = await server.abort_all_requests.remote()
        await _release(server)
        await asyncio.sleep(1.5)  # the client retries after 1 s: its resubmission waits at the closed gate
        await replica.resume_generation()
        return aborted, await task

    aborted, out = asyncio.run(interrupted())
    assert aborted["aborted_count"] == 1
    plain = LLMServerClient(config=config, load_balancer_handle=lb)
    ref = asyncio.run(plain.generate("partial-0", prompt_ids=PROMPTS[0], sampling_params=params))
    assert len(ref.token_ids) == 300 and out.token_ids == ref.token_ids
    assert out.log_probs == pytest.approx(ref.log_probs, abs=1e-9)


def test_rollout_options_are_checked(model_dir):
    from pat_integrations.verl.settings import PatRolloutSettings

    config = ppo_config(model_dir("llama"))
    rollout_config, model_config = config.actor_rollout_ref.rollout, config.actor_rollout_ref.model
    settings = PatRolloutSettings.from_verl(rollout_config, model_config, 2)
    assert settings.rollout.tail_batching.eta == 0.5 and settings.rollout.group_size == 2
    pat = rollout_config.engine_kwargs["pat"]
    for bad, match in [({"eta": 9}, "tail_batching: tail batching eta"), ({"etta": 0.2}, r"unknown .*\['etta'\]")]:
        with open_dict(config):
            pat["tail_batching"] = bad
        with pytest.raises(ValueError, match=match):
            PatRolloutSettings.from_verl(rollout_config, model_config, 2)
    with open_dict(config):
        pat["tail_batching"] = True
        pat["group_sizing"] = {"sizes": [2, 4, 3]}
    with pytest.raises(ValueError, match="multiple of every group size, got 3"):
        PatRolloutSettings.from_verl(rollout_config, model_config, 2)
    with open_dict(config):
        del pat["responses_per_step"]
    with pytest.raises(ValueError, match="responses_per_step is required"):
        PatRolloutSettings.from_verl(rollout_config, model_config, 2)
