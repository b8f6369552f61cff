"""Decode graphs in a running engine (stand-in backend, worker processes, float64): captured at
start-up, captured inside a live switch for the batch sizes that can still occur, restored without a
capture when a switch returns to a layout, dropped with the KV on sleep, never captured under
``enforce_eager``; the tokens stay those of transformers.

The real ``torch.cuda.CUDAGraph`` backend is exercised by the ``gpu`` tests at the end (skipped
without CUDA).
"""

from __future__ import annotations

import pytest
import torch

from conftest import MAX_NEW, PROMPTS, hf_greedy_batch
from pat_engine import Engine, SamplingParams
from pat_engine.config import graph_ladder

GREEDY = [SamplingParams(max_new_tokens=m) for m in MAX_NEW]  # 48, 20, 56, 30, 12, 40
LADDER = graph_ladder(16)  # 1, 2, 4, 8, 16


def _graphs(engine: Engine) -> list[dict]:
    return [s["graphs"] for s in engine.worker_stats()]


@pytest.mark.slow
def test_graphs_across_a_live_switch_and_sleep(model_dir):
    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float64", graph_backend="standin", max_num_seqs=16) as engine:
        assert all(g["captured"] == list(LADDER) and g["lazy_captures"] == 0 for g in _graphs(engine))  # start-up
        assert all(g["warmup_forwards"] == 2 + len(LADDER) - 1 for g in _graphs(engine))  # new shapes: 2, then 1
        warm = _graphs(engine)[0]["warmup_forwards"]

        # TP1xDP2 -> TP2xDP1 while all six requests run, then back to TP1xDP2 once two have finished
        outs = engine.generate(PROMPTS, GREEDY, switch_schedule=[(3, 2), (25, 1)], kv_transfer="migrate",
                               use_tqdm=False)
        assert [o.token_ids for o in outs] == hf_greedy_batch(model_dir("llama"))
        merge, split = engine.switches[-2:]
        assert merge.to_layout == "TP2xDP1" and split.to_layout == "TP1xDP2"
        assert merge.costs["requests"] == 6 and merge.costs["graphs_captured"] == 4  # 6 rows run as 8: 1, 2, 4, 8
        assert merge.costs["graphs_s"] > 0
        assert split.costs["requests"] == 4  # 48, 56, 30 and 40 new tokens: over two groups, at most 3 each
        # back at TP1 every weight and KV layer is where the start-up's graphs read them: they run again, and
        # nothing is captured
        assert split.costs["graphs_captured"] == 0 and split.costs["graphs_restored"] == len(LADDER)
        stats = _graphs(engine)
        assert all(g["captured"] == list(LADDER) and g["restored"] == len(LADDER) for g in stats)
        assert all(g["lazy_captures"] == 0 and g["replays"] > 0 for g in stats)
        assert all(g["warmup_forwards"] == warm + 2 + 3 for g in stats)  # TP2's new shapes: 2, then 1 a size

        # the next round's merge finds TP2's graphs too, and its way back TP1's again
        again = engine.generate(PROMPTS, GREEDY, switch_schedule=[(3, 2), (25, 1)], kv_transfer="migrate",
                                use_tqdm=False)
        assert [o.token_ids for o in again] == hf_greedy_batch(model_dir("llama"))
        merge, split = engine.switches[-2:]
        assert merge.costs["graphs_captured"] == 0 and merge.costs["graphs_restored"] == 4  # 1, 2, 4, 8
        assert split.costs["graphs_captured"] == 0 and split.costs["graphs_restored"] == len(LADDER)
        assert all(g["captures"] == len(LADDER) + 4 for g in _graphs(engine))
        # what each left aside, as the switch's price learns it (predictor.graph_seconds)
        assert merge.costs["graphs_left"] == LADDER and split.costs["graphs_left"] == (1, 2, 4, 8)
        rates = engine.coordinator.switching.cost_source
        assert rates.graphs_left == {2: {1, 2, 4, 8}}

        engine.sleep(level=1)  # drops every graph, those TP2 left too
        assert all(g["captured"] == [] for g in _graphs(engine)) and rates.graphs_left == {}
        engine.wake_up()
        again = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in again] == hf_greedy_batch(model_dir("llama"))
        assert all(g["captured"] and set(g["captured"]) <= set(LADDER) for g in _graphs(engine))  # lazily
        assert all(g["warmup_forwards"] == warm + 5 for g in _graphs(engine))  # shapes captured before


@pytest.mark.slow
def test_a_return_replays_its_graphs_over_weights_updated_while_away(model_dir, tmp_path):
    """An RL step's order: the round ends merged (TP2), the trainer's weights land on the TP2 shards, the next
    round returns to the base layout. The return writes the new weights into the TP1 storage they left and
    replays TP1's graphs over them: the tokens of transformers on the new checkpoint."""
    from rl_helpers import fresh_tensors, perturbed_checkpoint

    step1 = perturbed_checkpoint(model_dir("llama"), tmp_path / "step1", seed=10)
    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float64", graph_backend="standin", max_num_seqs=16) as engine:
        engine.generate(PROMPTS, GREEDY, switch_schedule=[(3, 2)], use_tqdm=False)
        assert str(engine.layout) == "TP2xDP1"
        engine.update_weights(fresh_tensors(step1))
        engine.reconfigure(tp=1)
        assert engine.switches[-1].costs["graphs_restored"] == len(LADDER)
        outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == hf_greedy_batch(step1)
        assert all(g["replays"] > 0 and g["captures"] == len(LADDER) + 4 for g in _graphs(engine))


@pytest.mark.slow
def test_enforce_eager_captures_nothing(model_dir):
    with Engine(model_dir("llama"), tp=1, dp=2, dtype="float64", graph_backend="standin", enforce_eager=True,
                max_num_seqs=16) as engine:
        outs = engine.generate(PROMPTS[:2], GREEDY[:2], switch_schedule=[(3, 2)], use_tqdm=False)
        assert [o.token_ids for o in outs] == hf_greedy_batch(model_dir("llama"))[:2]
        assert engine.switches[-1].costs["graphs_s"] == 0 and engine.switches[-1].costs["graphs_captured"] == 0
        assert all(g["captures"] == 0 and g["replays"] == 0 for g in _graphs(engine))


# ---- real CUDA graphs (a GPU machine) ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_give_the_eager_tokens(model_dir):
    """Float32 on one GPU: the same greedy tokens with CUDA graphs as with enforce_eager."""
    def run(**kw):
        with Engine(model_dir("llama"), device="cuda", dtype="float32", max_num_seqs=16, **kw) as engine:
            tokens = [o.token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]
            return tokens, _graphs(engine)

    eager, eager_stats = run(enforce_eager=True)
    graphed, stats = run()
    assert eager_stats[0]["captures"] == 0
    assert stats[0]["captured"] == list(LADDER) and stats[0]["replays"] > 0
    assert graphed == eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_backend_replays_what_it_captured():
    from pat_engine.worker.graph_backends import CudaGraphBackend

    x = torch.zeros(4, device="cuda")
    graph = CudaGraphBackend(torch.device("cuda")).capture(lambda: x * 2 + 1, warmups=1)
    x.fill_(3.0)
    graph.replay()
    assert graph.output.tolist() == [7.0] * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_captured_again_without_warm_ups_give_the_same_bits(model_dir):
    """Float32, one rank in process: graphs captured again over a new pool of the same geometry (as after a
    switch back or a wake-up) run no warm-up forward and replay the tokens and log-probs of the graphs
    captured after warm-ups, bit for bit; the tokens are the eager steps'."""
    from test_graph_capture import NUM_BLOCKS, _executor, _generate

    path = model_dir("llama")
    ex = _executor(path, graphs=True, device="cuda", dtype=torch.float32)
    ex.capture_graphs()
    warm = ex.graphs.stats.warmup_forwards
    first = _generate(ex)
    ex.allocate_kv(NUM_BLOCKS)  # drops every graph
    ex.capture_graphs()
    assert ex.graphs.stats.warmup_forwards == warm and ex.graphs.captured == (1, 2, 4, 8)
    again = _generate(ex)
    assert ex.graphs.stats.replays > 0 and ex.graphs.stats.lazy_captures == 0
    assert again == first
    eager = _generate(_executor(path, graphs=False, device="cuda", dtype=torch.float32))
    assert [[t for t, _ in seq] for seq in again] == [[t for t, _ in seq] for seq in eager]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_set_aside_and_restored_give_the_same_bits(model_dir):
    """Float32, one rank in process: CUDA graphs set aside while their pool's memory is seen with another
    geometry (as a switch to TP2 and back re-views it) and written through, then restored without a capture,
    give the bits of graphs that never left; a size captured after the restore joins their memory pool."""
    from test_graph_capture import NUM_BLOCKS, _executor, _generate

    path = model_dir("llama")
    ref = _executor(path, graphs=True, device="cuda", dtype=torch.float32)
    ref.capture_graphs(upto=4)
    want = _generate(ref)  # size 8 captured lazily
    ex = _executor(path, graphs=True, device="cuda", dtype=torch.float32)
    ex.capture_graphs(upto=4)
    stats, kvh, at = ex.graphs.stats, ex.kv.kv_heads, ex.kv.layers[0].data_ptr()
    assert ex.graphs.set_aside() == (1, 2, 4)
    ex.kv = ex.kv.regeometry(max(kvh // 2, 1), 2 * NUM_BLOCKS)  # another geometry over the same memory
    for layer in ex.kv.layers:
        layer.fill_(7.0)  # written through while the graphs wait (stale slots stay finite, as a migration's)
    ex.kv = ex.kv.regeometry(kvh, NUM_BLOCKS)
    assert ex.kv.layers[0].data_ptr() == at
    ex.capture_graphs(upto=4)
    assert stats.restored == 3 and stats.captures == 3 and ex.graphs.captured == (1, 2, 4)
    assert _generate(ex) == want and stats.lazy_captures == 1  # size 8, into the resumed pool
