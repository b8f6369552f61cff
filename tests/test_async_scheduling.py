"""Async scheduling (docs/async_scheduling.md): a decode step sent before the one in flight is answered,
its tokens that step's draw on the device. It may change when steps run, never what they compute.

Fast tier: the scheduler's following step (which rows, their positions, blocks and drawn rows; when
none may be built), and one in-process worker per DP group (the real driver and executors):
tokens, log-probs and finish reasons bit for bit equal to the synchronous schedule in bfloat16 and
float32 (``numerics="invariant"``), with rows ended by stop tokens run once more and dropped. Slow tier:
worker processes, TP2 (the drawn tokens reach the other rank through the group) and DP2, ranks
holding each answer until the next message (``hold_answers``, what a GPU does), with a live switch,
and a rank that fails while a following step is in flight (no request lost).
GPU (``gpu``): one CUDA rank with graphs, bfloat16 invariant, async on and off: the same bits.
"""

from __future__ import annotations

import time

import pytest
import torch

from pat_engine import Engine, SamplingParams
from pat_engine.core.inputs import RequestFactory
from pat_engine.core.scheduler import GroupScheduler
from pat_engine.model.arch import load_model_arch
from pat_engine.protocol import PENDING_TOKEN, StepResult
from pat_engine.tiny_model import TinyModelSpec, write_tiny_model

SPEC = TinyModelSpec(arch="qwen2", hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                     num_kv_heads=2, seed=11)
PROMPTS = [[(29 * i + 7 * j) % 380 + 5 for j in range(2 + (13 * i) % 17)] for i in range(8)]
STOPS = list(range(100, 160))  # ~15% of the vocabulary: temperature-1 rows end early, at random steps


def _params(i: int) -> SamplingParams:
    """Sampled (seeded, n=2) and greedy rows of ragged lengths; a stop token may end a sampled row after
    its second token; log-probs with the top 2."""
    return SamplingParams(max_new_tokens=5 + 3 * i, ignore_eos=True, logprobs=True, top_logprobs=2, n=2,
                          seed=50 + i, temperature=1.0 if i % 3 else 0.0, stop_token_ids=STOPS, min_new_tokens=2)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("async"), SPEC))


# ---- the scheduler's following step ---------------------------------------------------------------


def _running(path: str, lengths: list[int], blocks: int = 64) -> tuple[GroupScheduler, list]:
    """A scheduler whose sequences ran a prefill and are in a decode step (``max_new_tokens`` each)."""
    arch = load_model_arch(path)
    factory = RequestFactory(arch, None, arch.max_position, 0)
    sched = GroupScheduler(0, blocks, 4, 64, 4096)
    seqs = [factory.make_samples([5 + i] * 7, SamplingParams(max_new_tokens=m, ignore_eos=True))[0]
            for i, m in enumerate(lengths)]
    for seq in seqs:
        sched.add(seq)
    cmd, batch = sched.schedule()
    sched.on_result(batch, True, StepResult(cmd.step_id, 0, [7] * len(batch), None, 0.0))
    return sched, seqs


def test_the_following_step_runs_each_row_one_position_further_on_its_drawn_token(model_path):
    sched, seqs = _running(model_path, [1 + 2, 1 + 1, 1 + 4])  # the middle one ends with the token in flight
    decode, batch = sched.schedule()
    following, rows = sched.schedule_following(decode, batch, hold=True)
    assert rows == [seqs[0], seqs[2]] and following.follows == decode.step_id and following.hold
    assert [s.drawn_row for s in following.seqs] == [0, 2]
    assert all(s.token_ids == [PENDING_TOKEN] for s in following.seqs)
    assert [s.start_pos for s in following.seqs] == [seqs[0].length, seqs[2].length]  # the token in flight's
    # position 8 (a prompt of 7, the prefill's token, the token in flight) opens a third block of 4
    assert [len(s.new_blocks) for s in following.seqs] == [1, 1]
    sched.check_blocks()


def test_no_following_step_when_a_prefill_could_start_or_a_block_is_missing(model_path):
    arch = load_model_arch(model_path)
    waiting = RequestFactory(arch, None, arch.max_position, 0).make_samples([3] * 5, SamplingParams())[0]
    sched, seqs = _running(model_path, [9, 9])
    decode, batch = sched.schedule()
    sched.add(waiting)
    assert sched.schedule_following(decode, batch) is None  # the synchronous schedule prefills first
    tight, _ = _running(model_path, [9, 9], blocks=4)  # 8 tokens, 2 blocks each: none free
    decode, batch = tight.schedule()
    assert tight.schedule_following(decode, batch) is None  # someone would be preempted
    tight.check_blocks()


def test_a_waiting_request_without_room_does_not_stop_the_following_step(model_path):
    arch = load_model_arch(model_path)
    sched, seqs = _running(model_path, [9, 9], blocks=7)  # 2 blocks each: 3 free
    decode, batch = sched.schedule()
    sched.add(RequestFactory(arch, None, arch.max_position, 0).make_samples([3] * 13, SamplingParams())[0])
    assert not sched.can_admit_now()  # its 13 tokens need 4 blocks
    following, rows = sched.schedule_following(decode, batch)
    assert rows == seqs and [len(s.new_blocks) for s in following.seqs] == [1, 1]  # 1 block left
    sched.check_blocks()


# ---- the driver and real executors in this process -------------------------------------------------


def _generate(path: str, dtype: str, on: bool, kv_blocks: int, graphs: bool = False):
    from local_workers import local_driver

    driver = local_driver(path, dp=2, dtype=dtype, numerics="invariant", async_scheduling=on, kv_blocks=kv_blocks,
                          **({"graph_backend": "standin", "max_graph_batch": 16} if graphs else {}))
    families = driver.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    outs = [[(s.output_ids, s.logprobs, s.top_logprobs, s.finish_reason, s.stop_reason) for s in f] for f in families]
    steps = driver.pool.steps
    preempted = sum(s.preemptions for f in families for s in f)
    assert not graphs or all(ex.graphs.stats.replays > 0 for ex in driver.pool.executors)
    return outs, steps, sum(len(s.output_ids) for f in families for s in f), preempted


@pytest.mark.parametrize("dtype,kv_blocks,graphs", [("bfloat16", 256, False), ("float32", 256, False),
                                                    ("float32", 14, False), ("bfloat16", 256, True)])
def test_following_steps_give_the_synchronous_schedules_bits(model_path, dtype, kv_blocks, graphs):
    """256 blocks of 4 tokens per group hold every request; 14 do not: requests wait for room while
    others decode, and some are preempted and recomputed. ``graphs``: decode steps through the graphs'
    bookkeeping (the stand-in backend: padded to the ladder, inputs copied into the graphs' buffers)."""
    sync, sync_steps, tokens, sync_preempted = _generate(model_path, dtype, False, kv_blocks, graphs)
    overlapped, steps, same_tokens, preempted = _generate(model_path, dtype, True, kv_blocks, graphs)
    assert overlapped == sync and tokens == same_tokens
    assert not any(c.follows for c in sync_steps)
    following = [c for c in steps if c.follows is not None]
    assert len(following) > len(steps) // (4 if kv_blocks > 100 else 8)  # many went out behind another
    assert any(f[3] == "stop" for fam in sync for f in fam) and any(f[3] == "length" for fam in sync for f in fam)
    # rows ended by a stop token ran once more in a following step; their tokens were dropped
    rows = [sum(len(c.seqs) for c in run if not c.is_prefill) for run in (sync_steps, steps)]
    assert rows[0] < rows[1]
    if kv_blocks < 100:  # following steps went out while requests waited for room, between prefills
        assert sync_preempted > 0 and preempted > 0
        last_prefill = max(i for i, c in enumerate(steps) if c.is_prefill)
        assert any(c.follows is not None for c in steps[:last_prefill])


# ---- worker processes ----------------------------------------------------------------------------


def _engine_run(engine: Engine, on: bool, hold: bool, start_tp: int, schedule=None) -> list:
    engine.reconfigure(tp=start_tp)
    engine.coordinator.stepping.set_async_scheduling(on, hold_answers=hold)
    outs = engine.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))], switch_schedule=schedule,
                           kv_transfer="migrate" if schedule else None, use_tqdm=False)
    return [[(s.token_ids, s.logprobs, s.finish_reason) for s in (o.samples or [o])] for o in outs]


@pytest.mark.slow
def test_worker_processes_holding_answers_give_the_synchronous_bits_across_tp_dp_and_a_switch(model_path):
    with Engine(model_path, tp=1, dp=2, dtype="float32", numerics="invariant") as engine:
        sync = _engine_run(engine, False, False, 1)
        assert _engine_run(engine, True, True, 2) == sync  # TP2: rank 1 gets the drawn tokens from rank 0
        assert _engine_run(engine, True, True, 1) == sync  # DP2, both groups two steps deep
        assert _engine_run(engine, True, False, 1) == sync  # answered at once (what a CPU rank does)
        before = len(engine.switches)
        assert _engine_run(engine, True, True, 1, schedule=[(4, 2)]) == sync  # drained at the switch
        assert [e.ok for e in engine.switches[before:]] == [True]


def test_the_command_line_flag_reaches_the_engine_config(model_path):
    import argparse

    from pat_engine.config import EngineConfig
    from pat_engine.serve.engine_args import EngineArgs, add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv, on in ((["--async-scheduling"], True), ([], False), (["--no-async-scheduling"], False)):
        args = EngineArgs.from_namespace(parser.parse_args(["--model", model_path, *argv]))
        # what EngineArgs.build starts the engine with (on the CPU: the default is off there)
        assert EngineConfig.from_kwargs(model_path, **args.engine_kwargs()).async_scheduling_on() is on


def test_async_scheduling_defaults_to_on_for_cuda_and_off_on_the_cpu(model_path):
    """Unset, the GPU sends steps ahead (where the fourth H100 run measured it faster) and the CPU does not
    (no gain there); set, either device does as told."""
    from pat_engine.config import EngineConfig

    assert EngineConfig(model=model_path, device="cuda").async_scheduling_on()
    assert not EngineConfig(model=model_path).async_scheduling_on()
    assert not EngineConfig(model=model_path, device="cuda", async_scheduling=False).async_scheduling_on()
    assert EngineConfig(model=model_path, async_scheduling=True).async_scheduling_on()


@pytest.mark.slow
def test_aborts_while_following_steps_are_in_flight_leave_the_others_exact_and_free_every_block(model_path):
    """Two long requests are aborted mid-flight (ranks holding answers, a following step out): they end
    with a prefix of what they would have drawn, the others' bits are the synchronous run's, and every
    KV block is free once the engine is idle."""
    params = [_params(i) for i in range(len(PROMPTS))]
    long = SamplingParams(max_new_tokens=300, ignore_eos=True, logprobs=True, temperature=1.0, seed=7)
    with Engine(model_path, tp=1, dp=2, dtype="float32", numerics="invariant", max_model_len=512) as engine:
        stepping = engine.coordinator.stepping
        sync = _engine_run(engine, False, False, 1)
        stepping.set_async_scheduling(True, hold_answers=True)
        doomed = [engine.submit([9, 8, 7, 6], long), engine.submit([5, 4, 3], long)]
        kept = [engine.submit_samples(p, sp) for p, sp in zip(PROMPTS, params)]
        for handle in doomed:
            while handle.num_generated < 5:
                time.sleep(0.005)
        assert engine.abort([h.request_id for h in doomed]) == 2
        for handles in kept:
            for h in handles:
                assert h.wait(60)
        outs = [[(h.output().token_ids, h.output().logprobs, h.output().finish_reason) for h in hs] for hs in kept]
        assert outs == sync
        assert [h.output().finish_reason for h in doomed] == ["abort", "abort"]
        assert all(5 <= len(h.output().token_ids) < 300 for h in doomed)
        stepping.set_async_scheduling(False)
        whole = engine.generate([[9, 8, 7, 6], [5, 4, 3]], long, use_tqdm=False)
        for handle, out in zip(doomed, whole):
            cut = handle.output()
            assert (cut.token_ids, cut.logprobs) == (out.token_ids[:len(cut.token_ids)], out.logprobs[:len(cut.token_ids)])
        kv = engine.kv_blocks()
        assert kv["invariants"] == "ok" and kv["unfinished"] == 0
        assert all(g["free"] == g["total"] for g in kv["groups"])  # free counts the cached ones

@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "raise"])
def test_a_rank_failing_with_a_following_step_in_flight_loses_no_request(model_dir, how):
    """TP2, ranks holding answers: rank 0 fails at its 12th step (a following step, its previous answer
    held), by dying or by raising. The world restarts, every request is recomputed, and the tokens are
    transformers' greedy ones."""
    from conftest import MAX_NEW, PROMPTS as HF_PROMPTS, hf_greedy_batch
    from fault_injection import FAULT_WORKER, inject_fault

    path = model_dir("llama")
    with Engine(path, tp=2, dp=1, dtype="float64", worker_class=FAULT_WORKER, async_scheduling=True) as engine:
        engine.coordinator.stepping.set_async_scheduling(True, hold_answers=True)
        inject_fault(engine, [0], "step", how, after=11)
        outs = engine.generate(HF_PROMPTS, [SamplingParams(max_new_tokens=m) for m in MAX_NEW], use_tqdm=False)
        assert [o.token_ids for o in outs] == hf_greedy_batch(path)
        assert len(engine.worker_failures) == 1 and "rank 0" in engine.worker_failures[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_with_graphs_async_scheduling_gives_the_synchronous_bits(model_path):
    with Engine(model_path, device="cuda", dtype="bfloat16", numerics="invariant", max_num_seqs=32) as engine:
        assert engine.coordinator.stepping.hold_answers  # a CUDA rank answers a step after launching the next
        sync = _engine_run(engine, False, True, 1)
        assert _engine_run(engine, True, True, 1) == sync
        stats = engine.worker_stats()[0]["graphs"]
        assert stats["replays"] > 0
