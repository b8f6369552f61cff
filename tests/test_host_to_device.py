"""``sampling.host.to_device``: host lists reach a device with their values and dtypes (on CUDA through
pinned memory without waiting for the stream: test_sampler_device_path.py's gpu test)."""

from __future__ import annotations

import torch

from pat_engine.sampling.host import to_device
from pat_engine.sampling.seeds import MASK64


def test_values_and_dtypes_are_those_torch_tensor_gives():
    cases = [([1, 2, 3], torch.long), ([0.1, 1e-300, 2.5], torch.float64), ([0.1, -1.5], torch.float32),
             ([(2**64 - 5) & MASK64], torch.uint64), ([], torch.long)]
    for values, dtype in cases:
        got = to_device(values, dtype, "cpu")
        want = torch.tensor(values, dtype=dtype)
        assert got.dtype == want.dtype and got.device.type == "cpu" and torch.equal(got.view(-1), want.view(-1))
