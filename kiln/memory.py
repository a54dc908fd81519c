"""How many KV blocks the budget buys."""

from __future__ import annotations

import torch

from kiln.config import CacheConfig
from kiln.errors import ConfigError

DEFAULT_FRACTION = {"cpu": 0.2, "cuda": 0.85}


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ConfigError("cannot read MemAvailable from /proc/meminfo; set --kv-cache-memory")


def num_kv_blocks(
    cache: CacheConfig,
    bytes_per_block: int,
    device: torch.device,
    max_useful_blocks: int,
    graph_reserve: int = 0,
) -> int:
    """Blocks for the KV budget: bytes if given, else a fraction of free memory less the
    measured graph memory; never more than the scheduler could ever use."""
    if cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    else:
        fraction = cache.kv_cache_memory_fraction or DEFAULT_FRACTION.get(device.type, 0.25)
        budget = int(available_memory(device) * fraction) - graph_reserve
    return min(max(0, budget) // bytes_per_block, max_useful_blocks)
