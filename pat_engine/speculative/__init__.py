"""Speculative decoding without a draft model (docs/speculative.md).

The worker imports ``spec.verify``; the driver ``spec.manager`` and ``spec.proposer``
(which import ``pat_engine.core``): this package's own import stays light for workers.
"""

from pat_engine.speculative.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
