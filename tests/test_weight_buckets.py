"""The driver's bucket loop for in-memory weight updates (core/weight_sync.py): an update that stops after
its first bucket leaves the model part old, part new, and says so, whichever way the update came."""

from __future__ import annotations

import pytest

from pat_engine.core.served_weights import ServedWeights
from pat_engine.core.weight_sync import WeightSync
from pat_engine.errors import InvalidRequestError


def _sync() -> WeightSync:
    sync = WeightSync.__new__(WeightSync)  # the bucket loop reads only the served-weights record
    sync.weights = ServedWeights("model")
    return sync


def _buckets(fail_at: int):
    """Buckets 0, 1, ...; checking bucket ``fail_at`` refuses it (as a later bucket's bad name would)."""
    for i in range(3):
        if i == fail_at:
            raise InvalidRequestError(f"weight 'w{i}': no such parameter")
        yield [f"w{i}"]


def test_a_failure_after_the_first_bucket_marks_the_model_part_updated():
    sync = _sync()
    with pytest.raises(InvalidRequestError, match="w2"):
        sync._in_buckets(_buckets(fail_at=2), len)
    assert sync.weights.stale and not sync.weights.on_disk


def test_a_failure_in_the_first_bucket_leaves_the_model_as_it_was():
    sync = _sync()
    with pytest.raises(InvalidRequestError, match="w0"):
        sync._in_buckets(_buckets(fail_at=0), len)
    assert not sync.weights.stale and sync.weights.on_disk
    assert sync._in_buckets(_buckets(fail_at=-1), len) == 3 and not sync.weights.stale
