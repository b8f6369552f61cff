"""Whether the sampler may read tensor values on the host.

On the CPU a value read (``.tolist()``, ``bool(t.any())``, ``nonzero``) costs nothing, so paths may
size their work from the data: a partial sort grown until it holds a row's top_p prefix, the log of
each row's sum by Python's ``math.log``. On a GPU each such read stalls the stream until every
kernel before it has run, so the decode step could not overlap anything; there the sampler takes
the data-independent way (a full sort, ``torch.log`` per element) and the step's results cross to
the host once, at the end (``DeviceSample.to_host``). Both ways give the same draws; log-probs differ
only in the last bit of a library log, between devices, never with the batch. The other way, host
lists reach the device through ``host_tensors.to_device``, which does not wait for the stream either.
"""

from __future__ import annotations

import torch


def reads_are_free(x: torch.Tensor) -> bool:
    """Whether reading ``x``'s values on the host costs no device synchronisation (a CPU tensor)."""
    return x.device.type == "cpu"
