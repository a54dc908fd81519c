"""Engine configuration: small frozen dataclasses, validated once at construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch

from kiln.compilation.config import CompilationConfig
from kiln.errors import ConfigError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "t": 1e12,
    "tb": 1e12,
}


def parse_bytes(value: int | float | str) -> int:
    """Parse '2GiB', '512MB', '1e9' or a number of bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(f"cannot parse memory size {value!r}; use e.g. '2GiB', '512MB' or bytes")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # At most one of the two budgets; neither: the device's default fraction of free memory.
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        frac = self.kv_cache_memory_fraction
        if frac is not None and not 0 < frac <= 1:
            raise ConfigError(f"kv_cache_memory_fraction must be in (0, 1], got {frac}")
        if frac is not None and self.kv_cache_memory is not None:
            raise ConfigError(
                "both kv_cache_memory and kv_cache_memory_fraction were given; pass one: "
                "--kv-cache-memory (bytes, e.g. 2GiB) or --kv-cache-memory-fraction"
            )


# The step's token budget when none is given. On the CPU a prefill chunk stalls every running
# decode for as long as it runs: a 2048-token chunk of a 4k prompt took 12.4 s on 2 cores, a
# 512-token one 3.5 s, and 512 also prefilled the prompt faster (240 vs 189 tok/s: the torch
# backend's masked attention over the whole context grows with the chunk).
DEFAULT_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: DEFAULT_BATCHED_TOKENS for the device
    max_model_len: int | None = None  # None: the model's own context length

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def for_device(self, device: torch.device) -> SchedulerConfig:
        """This config with the device's defaults filled in."""
        if self.max_num_batched_tokens is not None:
            return self
        budget = DEFAULT_BATCHED_TOKENS.get(device.type, DEFAULT_BATCHED_TOKENS["cuda"])
        return replace(self, max_num_batched_tokens=budget)


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default model
    dtype: str = "float32"
    device: str = "auto"
    seed: int = 0
    tokenizer: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    enforce_eager: bool = False
    strict_graphs: bool = False  # every change the graph plan would make is an error
    attention_backend: str = "auto"  # auto, torch or triton
    boot_timeout: float | None = 1800.0  # seconds per boot phase; None or 0: no limit

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if self.boot_timeout is not None and self.boot_timeout < 0:
            raise ConfigError(
                f"boot_timeout must be >= 0 seconds (0: no limit), got {self.boot_timeout}"
            )
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(
                "device 'cuda' was requested but torch sees no CUDA GPU; use --device cpu"
            )
        return torch.device(self.device)
