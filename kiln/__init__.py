"""kiln: an LLM inference engine whose compilation and CUDA-graph modes never change silently.

The public names load on first use, so that `import kiln.bench` (an HTTP client) or `kiln
bench --help` does not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "kiln.llm",
    "LLMEngine": "kiln.engine.llm_engine",
    "build_engine": "kiln.boot.builder",
    "SamplingParams": "kiln.sampling_params",
    "CompletionOutput": "kiln.outputs",
    "RequestOutput": "kiln.outputs",
    "CacheConfig": "kiln.config.engine",
    "EngineConfig": "kiln.config.engine",
    "SchedulerConfig": "kiln.config.engine",
    "CompilationConfig": "kiln.config.compilation",
    "ConfigError": "kiln.errors",
    "InvalidRequestError": "kiln.errors",
    "KilnError": "kiln.errors",
    "ModelLoadError": "kiln.errors",
}

__all__ = [
    "LLM",
    "CacheConfig",
    "CompilationConfig",
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
    "build_engine",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads them
    from kiln.boot.builder import build_engine
    from kiln.config.compilation import CompilationConfig
    from kiln.config.engine import CacheConfig, EngineConfig, SchedulerConfig
    from kiln.engine.llm_engine import LLMEngine
    from kiln.errors import ConfigError, InvalidRequestError, KilnError, ModelLoadError
    from kiln.llm import LLM
    from kiln.outputs import CompletionOutput, RequestOutput
    from kiln.sampling_params import SamplingParams
