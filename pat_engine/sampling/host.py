"""Whether the sampler may read tensor values on the host.

On the CPU a value read (``.tolist()``, ``bool(t.any())``, ``nonzero``) costs nothing, so paths may
size their work from the data: a partial sort grown until it holds a row's top_p prefix, the log of
each row's sum by Python's ``math.log``. On a GPU each such read stalls the stream until every
kernel before it has run, so the decode step could not overlap anything; there the sampler takes
the data-independent way (a full sort, ``torch.log`` per element) and the step's results cross to
the host once, at the end (``DeviceSample.to_host``). Both ways give the same draws; log-probs differ
only in the last bit of a library log, between devices, never with the batch. The other way, host
lists reach the device through ``to_device``, which does not wait for the stream either.
"""

from __future__ import annotations

import torch


def reads_are_free(x: torch.Tensor) -> bool:
    """Whether reading ``x``'s values on the host costs no device synchronisation (a CPU tensor)."""
    return x.device.type == "cpu"


def to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Host ``values`` as a tensor on ``device``. On CUDA they cross from pinned memory without blocking:
    ``torch.tensor(values, device="cuda")`` copies from pageable memory and waits for the stream, every
    kernel queued before it, once per tensor (a temperature-1 step's sampling batch builds about ten)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)  # torch's pinned allocator keeps it until copied
