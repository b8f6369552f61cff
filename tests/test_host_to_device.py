"""``pat_engine.host_tensors``: host lists become the tensors ``torch.tensor`` would give, values and dtypes
alike (on CUDA ``to_device`` copies through pinned memory without waiting for the stream:
test_sampler_device_path.py's gpu test)."""

from __future__ import annotations

import numpy as np
import torch

from pat_engine.host_tensors import host_table, host_tensor, to_device
from pat_engine.sampling.seeds import MASK64


def test_values_and_dtypes_are_those_torch_tensor_gives():
    cases = [([1, 2, 3], torch.long), ([0.1, 1e-300, 2.5], torch.float64), ([0.1, -1.5, 1 / 3], torch.float32),
             ([(2**64 - 5) & MASK64, 7], torch.uint64), ([-4, 2**31 - 1], torch.int32), ([], torch.long),
             ([True, False], torch.bool)]
    for values, dtype in cases:
        want = torch.tensor(values, dtype=dtype)
        for got in (host_tensor(values, dtype), to_device(values, dtype, "cpu")):
            assert got.dtype == want.dtype and got.device.type == "cpu" and got.shape == want.shape
            assert torch.equal(got.view(-1), want.view(-1)), (values, dtype)
    for values, dtype in [(np.array([0.25, 1e-300]), torch.float64), (np.array([3, 4], dtype=np.int64), torch.long),
                          (np.array([1.5, 2.0]), torch.float32)]:  # numpy arrays, already machine numbers
        got = to_device(values, dtype, "cpu")
        assert got.dtype == dtype and torch.equal(got, torch.tensor(values.tolist(), dtype=dtype)), (values, dtype)


def test_a_table_is_cut_or_zero_padded_to_its_width_and_height():
    rows = [[5, 6, 7], [8], []]
    assert host_table(rows, 2).tolist() == [[5, 6], [8, 0], [0, 0]]
    assert host_table(rows, 4, height=4).tolist() == [[5, 6, 7, 0], [8, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert host_table(rows, 2).dtype == torch.long
