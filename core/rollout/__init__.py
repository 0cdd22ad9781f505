"""rollout: one interface for sampling from language models in RL training.

Importing this package is cheap: no torch or engine is imported until a backend is loaded.
"""

from rollout.contract.errors import (
    BackendContractError,
    BackendReleasedError,
    EngineDeadError,
    NoReplicaError,
    GenerationError,
    OverloadedError,
    InvalidRequestError,
    PluginLoadError,
    RolloutError,
    RolloutTimeoutError,
    UnknownBackendError,
    UnsupportedError,
    WeightsDirtyError,
)
from rollout.hookspecs import hookimpl
from rollout.contract.schemas import (
    Capabilities,
    Chunk,
    Completion,
    ImagePart,
    Message,
    Request,
    Result,
    SamplingParams,
    StructuredOutputs,
    TextPart,
    Timing,
    TokenLogprob,
    Tool,
    ToolCall,
    WeightSpan,
)
from rollout.api import Rollout, load_backend
from rollout.front import Stream
from rollout.contract.sampler import Sampler
from rollout.contract.plugins import available_backends
from rollout import _moved

_moved.install()

__version__ = "0.1.0"

__all__ = [
    "BackendContractError",
    "BackendReleasedError",
    "Capabilities",
    "Chunk",
    "Completion",
    "EngineDeadError",
    "NoReplicaError",
    "OverloadedError",
    "GenerationError",
    "ImagePart",
    "InvalidRequestError",
    "Message",
    "PluginLoadError",
    "Request",
    "Result",
    "Timing",
    "Rollout",
    "Sampler",
    "ServedRollout",
    "open_sampler",
    "Stream",
    "RolloutError",
    "RolloutTimeoutError",
    "SamplingParams",
    "StructuredOutputs",
    "WeightsDirtyError",
    "WeightSpan",
    "TextPart",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "UnknownBackendError",
    "UnsupportedError",
    "available_backends",
    "hookimpl",
    "load_backend",
]


def __getattr__(name: str):
    # The client side (HTTP, replicas) is loaded on first use.
    if name in ("ServedRollout", "open_sampler"):
        from rollout.service import served

        return getattr(served, name)
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")
