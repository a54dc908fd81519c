"""What a user asks for and what it resolves to: the engine configuration, --compilation-config
(with vLLM's spellings) and the graph plan. Nothing here imports torch."""

from kiln.config.compilation import CompilationConfig
from kiln.config.compilation_values import CUDAGraphMode
from kiln.config.engine import CacheConfig, EngineConfig, SchedulerConfig, parse_bytes

__all__ = [
    "CUDAGraphMode",
    "CacheConfig",
    "CompilationConfig",
    "EngineConfig",
    "SchedulerConfig",
    "parse_bytes",
]
