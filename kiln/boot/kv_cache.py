"""How many KV blocks the budget buys: the user's bytes, or a fraction of the memory left free
once the weights are loaded and the graphs measured; never more than the scheduler could use,
never fewer than one full context."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from kiln.attention.kv_int8 import cache_row_width
from kiln.config.engine import CacheConfig
from kiln.errors import ConfigError
from kiln.models.config import ModelConfig

logger = logging.getLogger(__name__)

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
    row = cache_row_width(model.head_dim, dtype)
    per_token = len(model.attention_layer_ids) * 2 * model.num_kv_heads * row
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


def state_bytes_per_sequence(model: ModelConfig, dtype: torch.dtype) -> int:
    """A hybrid model's Gated DeltaNet state of one sequence, all layers (0 for others)."""
    if model.linear_attention is None:
        return 0
    return len(model.linear_layer_ids) * model.linear_attention.state_bytes(dtype)


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
    state_checkpoints: int = 0,
    draft_bytes_per_block: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> int:
    """The number of KV blocks, or an error naming the remedy when they hold less than one
    context of `max_model_len` tokens. A hybrid model's state slots (one per sequence the
    scheduler may run) and prefix-cache checkpoints come out of the same budget first; a draft
    model's cache of as many blocks shares the budget (`draft_bytes_per_block`). `dtype` is the
    model's (the states'), `kv_dtype` the cache's (default the same)."""
    bs = cache.block_size
    per_block = kv_bytes_per_block(model, bs, kv_dtype or dtype) + draft_bytes_per_block
    per_seq = -(-max_model_len // bs)
    states = state_bytes_per_sequence(model, dtype) * (max_num_seqs + state_checkpoints)
    reserve = graph_reserve + (states if cache.kv_cache_memory is None else 0)
    cache = _less(cache, states)
    blocks = num_kv_blocks(cache, per_block, device, per_seq * max_num_seqs + 1, reserve)
    if blocks * bs < max_model_len:
        raise ConfigError(
            f"the KV cache holds {blocks * bs} tokens ({blocks} blocks of {per_block} bytes), "
            f"fewer than max_model_len={max_model_len}: raise --kv-cache-memory "
            f"(to at least {(per_seq * per_block + states) / 2**20:.1f}MiB) or lower "
            "--max-model-len"
        )
    if states:
        logger.info(
            "hybrid model: %d KV bytes per token (%d attention layers), %d state bytes per "
            "sequence (%d Gated DeltaNet layers) x (%d slots + %d more: prefix-cache checkpoints "
            "and speculation's per-token states) = %.1f MiB of state",
            per_block // bs, len(model.attention_layer_ids),
            states // (max_num_seqs + state_checkpoints), len(model.linear_layer_ids),
            max_num_seqs, state_checkpoints, states / 2**20,
        )  # fmt: skip
    return blocks


def _less(cache: CacheConfig, state_bytes: int) -> CacheConfig:
    """A fixed KV budget less the state slots' bytes."""
    if cache.kv_cache_memory is None or not state_bytes:
        return cache
    if state_bytes >= cache.kv_cache_memory:
        raise ConfigError(
            f"the state slots of {state_bytes / 2**20:.1f}MiB fill the KV cache budget of "
            f"{cache.kv_cache_memory / 2**20:.1f}MiB: raise --kv-cache-memory or lower "
            "--max-num-seqs"
        )
    return replace(cache, kv_cache_memory=cache.kv_cache_memory - state_bytes)
