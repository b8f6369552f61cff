"""Host lists as tensors, fast, and on their way to a device without waiting for it.

A step's inputs start as Python lists (token ids, positions, block tables, sampling settings).
``torch.tensor`` checks every element of a list one by one; an ``array`` of machine integers or
doubles wrapped by ``torch.frombuffer`` gives the same values several times faster, and numpy does
for nested lists (``bench/step_prepare.py`` measures the builder that uses them). On CUDA,
``torch.tensor(values, device="cuda")`` copies from pageable memory and waits for the stream, every
kernel queued before it; ``to_device`` copies from pinned memory without blocking.
"""

from __future__ import annotations

from array import array
from typing import Sequence

import numpy as np
import torch

_TYPECODES = {torch.long: "q", torch.float64: "d", torch.float32: "f", torch.uint64: "Q", torch.int32: "i"}


def host_tensor(values: Sequence | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of ``values`` (the values and dtype ``torch.tensor(values, dtype=dtype)`` gives)."""
    if isinstance(values, np.ndarray):  # already machine numbers: no copy where the dtype agrees
        return torch.from_numpy(values.reshape(-1)).to(dtype)
    code = _TYPECODES.get(dtype)
    if code is None or not values:
        return torch.tensor(values, dtype=dtype)
    return torch.frombuffer(array(code, values), dtype=dtype)  # the tensor keeps the array alive


def host_table(rows: Sequence[Sequence[int]], width: int, height: int | None = None) -> torch.Tensor:
    """An int64 (height, width) CPU tensor: row i holds ``rows[i]`` cut or zero-padded to ``width``; rows
    past ``len(rows)`` (up to ``height``) are zeros."""
    out = np.zeros((len(rows) if height is None else height, width), dtype=np.int64)
    for i, row in enumerate(rows):
        k = min(len(row), width)
        out[i, :k] = row[:k]
    return torch.from_numpy(out)


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Host ``values`` as a tensor on ``device``; on CUDA through pinned memory, without blocking."""
    host = host_tensor(values, dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)  # torch's pinned allocator keeps it until copied
