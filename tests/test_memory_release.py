"""Releasing and restoring memory (sleep / wake_up) against in-process fake workers: no processes.

The fake pool fails any step dispatched while its KV is released and any restore of a pool that
was never released, so these tests check the driver never runs a request on released memory and
never replaces live KV. Token equality with real workers is in tests/test_memory_release_e2e.py.
"""

from __future__ import annotations

import pytest

from driver_fixtures import expected_tokens, make_driver
from pat_engine.core.sleep_state import DISCARDED, OFFLOADED, SleepState, check_tags, tags_for_level
from pat_engine.errors import InvalidRequestError, LayoutError
from pat_engine.predictor.policy import SwitchDecision
from pat_engine.protocol.calls import ReleaseMemory, ReloadWeights, RestoreMemory, WorkerCall

KV = {"kv_cache", "cuda_graph"}


def memory_calls(driver) -> list[WorkerCall]:
    return [c for c in driver.pool.calls if isinstance(c, (ReleaseMemory, RestoreMemory, ReloadWeights))]


def test_release_retracts_running_requests_and_nothing_runs_until_restored():
    d = make_driver()
    seqs = [d.add([1, 2, 3, 4, 5, 6, 7, 8, 9], 12) for _ in range(3)] + [d.add([7, 7], 20)]
    d.ticks(4)  # prefilled and decoding
    assert any(s.block_table for s in seqs)
    d.coord.memory_release.release(KV, OFFLOADED)
    assert all(not s.block_table and s.num_cached == 0 for s in seqs)  # KV given back, prefilled again later
    assert d.used_blocks() == 0 and all(s.blocks.num_cached == 0 for s in d.coord.stepping.schedulers)
    steps = len(d.pool.steps)
    d.ticks(20)
    assert len(d.pool.steps) == steps and not any(s.finished for s in seqs)  # waits: nothing dispatched
    assert d.coord.memory_release.restore(KV) == KV
    d.run()
    assert all(s.output_ids == expected_tokens(s) for s in seqs)


def test_waking_an_awake_engine_is_a_no_op_that_leaves_running_requests_alone():
    d = make_driver()
    seqs = [d.add([3, 4, 5, 6, 7, 8, 9, 10], 16) for _ in range(2)]
    d.ticks(3)
    tables = [list(s.block_table) for s in seqs]
    assert d.coord.memory_release.restore({"weights", "kv_cache", "cuda_graph"}) == set()
    assert memory_calls(d) == [] and [s.block_table for s in seqs] == tables
    d.run()
    assert all(s.output_ids == expected_tokens(s) for s in seqs)


def test_release_and_restore_are_idempotent_and_restore_only_what_was_released():
    d = make_driver()
    d.coord.memory_release.release(KV, OFFLOADED)
    assert d.coord.memory_release.release(KV, OFFLOADED) == 0  # already released
    assert [type(c) for c in memory_calls(d)] == [ReleaseMemory]
    assert d.coord.memory_release.restore({"weights"}) == set()  # the weights were never released
    assert d.coord.memory_release.restore(KV) == KV
    assert d.coord.memory_release.restore(KV) == set()
    assert [type(c) for c in memory_calls(d)] == [ReleaseMemory, RestoreMemory]


def test_discarded_weights_come_back_from_disk_or_wait_for_the_trainer():
    d = make_driver()
    d.coord.memory_release.release({"weights", "kv_cache"}, DISCARDED)
    assert d.coord.memory_release.state == SleepState(kv_cache=True, weights=DISCARDED)
    d.coord.memory_release.restore({"weights"})
    assert memory_calls(d)[-1] == ReloadWeights("fake")
    assert d.coord.memory_release.state.asleep  # the KV is still released
    d.coord.memory_release.restore({"kv_cache"})
    assert not d.coord.memory_release.state.asleep and d.coord.may_dispatch()

    d.coord.weights.updated_in_memory()  # the served weights now exist only in memory
    d.coord.memory_release.release({"weights", "kv_cache"}, DISCARDED)
    seq = d.add([1, 2, 3], 4)  # queued while asleep
    d.coord.memory_release.restore({"weights", "kv_cache"})
    assert isinstance(memory_calls(d)[-1], RestoreMemory) and d.coord.weights.stale
    d.ticks(10)
    assert seq.output_ids == [] and not d.coord.may_dispatch()  # no step on zeroed weights
    d.coord.weights.updated_in_memory()  # the trainer pushed them
    d.run()
    assert seq.output_ids == expected_tokens(seq)


def test_no_layout_switch_while_memory_is_released():
    d = make_driver()
    d.coord.memory_release.release(KV, OFFLOADED)
    with pytest.raises(LayoutError, match="released"):
        d.coord.switching.switch(SwitchDecision(2, "test"))


def test_tags_and_levels():
    assert check_tags(None) == {"weights", "kv_cache", "cuda_graph"}
    with pytest.raises(InvalidRequestError, match="unknown memory tags"):
        check_tags(["gpu"])
    assert tags_for_level(1, on_gpu=False) == (KV, None)
    assert tags_for_level(1, on_gpu=True) == (KV | {"weights"}, OFFLOADED)
    assert tags_for_level(2, on_gpu=False) == (KV | {"weights"}, DISCARDED)
    with pytest.raises(InvalidRequestError, match="level"):
        tags_for_level(3, on_gpu=False)
