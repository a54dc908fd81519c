"""kiln: an LLM inference engine whose compilation and CUDA-graph modes never change silently."""

from kiln.config import CacheConfig, EngineConfig, SchedulerConfig
from kiln.engine import LLMEngine
from kiln.errors import ConfigError, InvalidRequestError, KilnError, ModelLoadError
from kiln.llm import LLM
from kiln.outputs import CompletionOutput, RequestOutput
from kiln.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "ConfigError",
    "EngineConfig",
    "InvalidRequestError",
    "KilnError",
    "LLMEngine",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]
