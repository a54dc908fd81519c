"""How many KV blocks the budget buys: the user's bytes, or a fraction of the memory left free
once the weights are loaded and the graphs measured; never more than the scheduler could use,
never fewer than one full context."""

from __future__ import annotations

import torch

from kiln.config.engine import CacheConfig
from kiln.errors import ConfigError
from kiln.models.config import ModelConfig

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


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    per_token = model.num_layers * 2 * model.num_kv_heads * model.head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


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


def size_kv_cache(
    cache: CacheConfig,
    model: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    max_num_seqs: int,
    graph_reserve: int = 0,
) -> int:
    """The number of KV blocks, or an error naming the remedy when they hold less than one
    context of `max_model_len` tokens."""
    bs = cache.block_size
    per_block = kv_bytes_per_block(model, bs, dtype)
    per_seq = -(-max_model_len // bs)
    blocks = num_kv_blocks(cache, per_block, device, per_seq * max_num_seqs + 1, graph_reserve)
    if blocks * bs < max_model_len:
        raise ConfigError(
            f"the KV cache holds {blocks * bs} tokens ({blocks} blocks of {per_block} bytes), "
            f"fewer than max_model_len={max_model_len}: raise --kv-cache-memory "
            f"(to at least {per_seq * per_block / 2**20:.1f}MiB) or lower --max-model-len"
        )
    return blocks
