"""pat-engine: LLM inference for RL rollouts that changes its tensor-parallel degree live."""

from pat_engine.core.engine import Engine, RequestHandle
from pat_engine.errors import (
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    LayoutError,
    ModelLoadError,
    PatEngineError,
    WorkerFailure,
)
from pat_engine.outputs import RequestOutput
from pat_engine.parallel.layout import Layout
from pat_engine.reference import reference_logprobs
from pat_engine.sampling.params import SamplingParams
from pat_engine.sampling.structured import StructuredOutput
from pat_engine.version import __version__

__all__ = [
    "__version__",
    "Engine",
    "RequestHandle",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
    "Layout",
    "reference_logprobs",
    "PatEngineError",
    "InvalidRequestError",
    "LayoutError",
    "ModelLoadError",
    "WorkerFailure",
    "EngineClosedError",
    "EngineDeadError",
]
