"""What an engine configuration resolves to on this machine before any weight is loaded: the
device, the context length, the attention backend and the graph plan. The engine boots on
them; `kiln info --plan-only` prints them without booting (no weights, no compilation, no
capture)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from kiln.attention.backend import AttentionBackend, AttentionShape
from kiln.attention.selector import ATTENTION_OPS, select_backend
from kiln.compiler.split_backend import check_splitting_ops
from kiln.config.engine import DTYPES, EngineConfig
from kiln.config.graph_plan import (
    AttentionCaps,
    DeviceCaps,
    GraphPlan,
    GraphSupport,
    resolve_graph_plan,
)
from kiln.config.plan_table import log_plan
from kiln.cudagraphs.graph_backend import GraphBackend
from kiln.errors import ConfigError
from kiln.layers.gated_deltanet import GDN_GRAPH_SUPPORT, GDN_OPS
from kiln.loader import ModelSource, open_model
from kiln.models.config import ModelConfig
from kiln.spec.speculator import check_speculation, verified_tokens_per_seq

logger = logging.getLogger(__name__)


def torch_dtype(config: EngineConfig) -> torch.dtype:
    return getattr(torch, DTYPES[config.dtype])


def kv_dtype(config: EngineConfig) -> torch.dtype:
    """The KV cache's element type: --kv-cache-dtype, or the model's (auto)."""
    name = config.cache.kv_cache_dtype
    if name == "int8":
        return torch.int8
    return torch_dtype(config) if name == "auto" else getattr(torch, DTYPES[name])


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            "device 'cuda' was requested but torch sees no CUDA GPU; use --device cpu"
        )
    return torch.device(config.device)


def for_device(config: EngineConfig) -> tuple[EngineConfig, torch.device]:
    """The device, and the config with its scheduler and cache defaults for that device."""
    device = resolve_device(config)
    scheduler = config.scheduler.for_device(device.type)
    return replace(config, scheduler=scheduler, cache=config.cache.for_device(device.type)), device


def device_caps(device: torch.device, graph_backend: GraphBackend | None = None) -> DeviceCaps:
    """CUDA devices capture graphs; so does any device given a graph backend (the CPU tests'
    emulator)."""
    if device.type == "cuda" or graph_backend is not None:
        return DeviceCaps(device.type, True)
    return DeviceCaps.cpu()


def select_attention(
    config: EngineConfig, model: ModelConfig, device: torch.device
) -> AttentionBackend:
    shape = AttentionShape(model.num_heads, model.num_kv_heads, model.head_dim)
    return select_backend(
        config.attention_backend, device, config.cache.block_size, shape, torch_dtype(config),
        kv_dtype(config),
    )  # fmt: skip


def resolve_max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    limit = model.max_position_embeddings
    asked = config.scheduler.max_model_len
    if asked is not None and asked > limit:
        raise ConfigError(
            f"max_model_len {asked} exceeds the model's context length {limit}; "
            f"pass --max-model-len {limit} or less"
        )
    return asked or limit


def mixer_caps(backend: AttentionBackend, model: ModelConfig) -> AttentionCaps:
    """What the model's token mixers allow the plan: the attention backend's, and for a hybrid
    model the Gated DeltaNet op's too (the lesser graph support, both ops split at)."""
    if not model.is_hybrid:
        return AttentionCaps(backend.name, backend.graph_support, backend.splitting_ops)
    gdn = GDN_GRAPH_SUPPORT[backend.state_core]
    support = max(backend.graph_support, gdn, key=_SUPPORT_ORDER.index)
    return AttentionCaps(
        f"{backend.name} with the Gated DeltaNet op ({backend.state_core})", support,
        (*backend.splitting_ops, GDN_OPS[backend.state_core]),
    )  # fmt: skip


_SUPPORT_ORDER = [GraphSupport.ALWAYS, GraphSupport.UNIFORM_BATCH,
                  GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE, GraphSupport.NEVER]  # fmt: skip


def resolve_plan(
    config: EngineConfig,
    backend: AttentionBackend,
    device: torch.device,
    graph_backend: GraphBackend | None,
    model: ModelConfig,
) -> GraphPlan:
    """The graph plan, logged: every change it made is a WARNING (an error when strict)."""
    check_splitting_ops(config.compilation.splitting_ops or (), (*ATTENTION_OPS, *GDN_OPS.values()))
    sched = config.scheduler
    # a verification step's rows: one per position where the backend takes them so
    per_seq = verified_tokens_per_seq(config.speculative)
    query_len = 1 if backend.drafts_as_decode_rows and not model.is_hybrid else per_seq
    plan = resolve_graph_plan(
        config.compilation,
        device_caps(device, graph_backend),
        mixer_caps(backend, model),
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs * (per_seq // query_len),
        uniform_decode_query_len=query_len,
        enforce_eager=config.enforce_eager,
        strict=config.strict_graphs,
    )
    log_plan(plan, logger)
    return plan


@dataclass(frozen=True)
class EnginePreview:
    config: EngineConfig  # scheduler defaults set for the device
    device: torch.device
    source: ModelSource
    attn_backend: AttentionBackend
    max_model_len: int
    plan: GraphPlan  # before boot measures graph memory (a fixed KV budget may cut the ladder)


def preview_engine(config: EngineConfig) -> EnginePreview:
    config, device = for_device(config)
    source = open_model(config.model)
    check_speculation(config.speculative, source.config)
    backend = select_attention(config, source.config, device)
    max_model_len = resolve_max_model_len(config, source.config)
    plan = resolve_plan(config, backend, device, None, source.config)
    return EnginePreview(config, device, source, backend, max_model_len, plan)


def keyed_model(source: ModelSource, config: EngineConfig, attention: AttentionBackend) -> dict:
    """The model's part of the compile cache key: its config, whether its weights may be packed,
    whether packed ones get dense copies and which kernel runs CPU linears (other ops in the
    graph), and its attention
    backend (another op and metadata type in the graph: a trace saved for one backend fails its
    guards under another)."""
    return {**source.config.to_dict(), "quantization": config.quantization,
            "prefill_weights": config.prefill_weights,
            "cpu_linears": config.cpu_linears,
            "packed_activations": config.packed_activations,
            "kv_cache_dtype": str(kv_dtype(config)),
            "attention_backend": attention.name}  # fmt: skip
