"""`kiln info`: what the model is and how the engine resolved its configuration; with
`--plan-only`, what it would resolve to, without loading weights, compiling or capturing."""

from __future__ import annotations

import argparse

import torch

from kiln.boot.builder import build_engine
from kiln.boot.preview import EnginePreview, keyed_model, kv_dtype, preview_engine
from kiln.cli.engine_args import engine_kwargs
from kiln.compile_cache.entry import CompileCacheEntry, entry_for_plan, is_sealed
from kiln.config.engine import EngineConfig
from kiln.config.options import engine_config
from kiln.config.plan_table import plan_table
from kiln.cudagraphs.graph_backend import CaptureStats
from kiln.engine.llm_engine import BootReport, LLMEngine
from kiln.loader.tokenizer import Tokenizer
from kiln.models.config import ModelConfig

NOT_COMPILED = "none (mode 0 compiles nothing)"  # the compile cache and torch.compile rows


def _model_rows(path: str, m: ModelConfig, tokenizer: Tokenizer) -> list[tuple[str, str]]:
    return [
        ("model", path),
        ("architecture", m.architecture),
        ("parameters", f"{m.num_params / 1e6:.1f} M"),
        ("layers", str(m.num_layers)),
        ("hidden size", str(m.hidden_size)),
        ("intermediate size", str(m.intermediate_size)),
        ("attention heads (q / kv)", f"{m.num_heads} / {m.num_kv_heads}, head dim {m.head_dim}"),
        ("vocabulary", str(m.vocab_size)),
        ("context length", str(m.max_position_embeddings)),
        ("rope", f"theta {m.rope_theta:g}, scaling {m.rope_scaling or 'none'}"),
        ("tied embeddings", str(m.tie_word_embeddings)),
        *_moe_rows(m),
        *_hybrid_rows(m),
        ("chat template", "yes" if tokenizer.has_chat_template else "no"),
    ]


def _hybrid_rows(m: ModelConfig) -> list[tuple[str, str]]:
    la = m.linear_attention
    if la is None:
        return []
    linear, attention = m.linear_layer_ids, m.attention_layer_ids
    state = la.state_bytes(torch.float32) * len(linear)
    return [
        ("layer types", f"Gated DeltaNet {_ranges(linear)}; attention {_ranges(attention)}"),
        (
            "Gated DeltaNet",
            f"{la.num_key_heads} key heads of {la.key_head_dim}, "
            f"{la.num_value_heads} value heads of {la.value_head_dim}, "
            f"conv kernel {la.conv_kernel}",
        ),
        ("state per sequence", f"{state / 2**10:.1f} KiB in float32, all Gated DeltaNet layers"),
    ]


def _moe_rows(m: ModelConfig) -> list[tuple[str, str]]:
    if m.moe is None:
        return []
    e = m.moe
    experts = f"top {e.top_k} of {e.num_experts}, intermediate {e.intermediate_size}"
    if e.shared_intermediate_size:
        experts += f", shared expert {e.shared_intermediate_size}"
    experts += f", normalised top-k {e.norm_topk_prob}"
    sparse = f"{len(m.sparse_layers)} of {m.num_layers}: {_ranges(m.sparse_layers)}"
    return [("experts", experts), ("sparse layers", sparse)]


def _ranges(layers: tuple[int, ...]) -> str:
    """0,1,2,5 -> '0-2, 5'."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _config_rows(
    config: EngineConfig, device: torch.device, max_model_len: int, backend: str, support: str
) -> list[tuple[str, str]]:
    return [
        ("device / dtype", f"{device} / {config.dtype}"),
        (
            "quantization",
            f"{config.quantization} (prefill weights: {config.prefill_weights}, "
            f"packed activations: {config.packed_activations})",
        ),
        ("max_model_len", str(max_model_len)),
        ("max_num_seqs", str(config.scheduler.max_num_seqs)),
        ("max_num_batched_tokens", str(config.scheduler.max_num_batched_tokens)),
        ("prefix caching", str(config.cache.enable_prefix_caching)),
        ("attention backend", f"{backend} (CUDA graphs: {support})"),
        ("speculative decoding", _speculative(config)),
    ]


def _speculative(config: EngineConfig) -> str:
    spec = config.speculative
    if spec is None:
        return "off (--speculative-config)"
    how = f"{spec.method}, {spec.num_speculative_tokens} tokens"
    if spec.model:
        how += f" from {spec.model}"
    if spec.method == "mtp":
        how += " from the checkpoint's MTP head (mtp.*)"
    if spec.method == "ngram":
        how += f", suffixes of {spec.prompt_lookup_min}-{spec.prompt_lookup_max} tokens"
    return f"{how}; off in steps of more than {spec.batch_size_limit} sequences"


def _boot_rows(engine: LLMEngine) -> list[tuple[str, str]]:
    st = engine.stats()
    bs = engine.config.cache.block_size
    compiled = engine.runner.compile_stats()
    summary = getattr(engine.runner.model, "weight_summary", [])
    return [
        *[("weights", f"{fmt}: {n} tensors, {b / 2**20:.1f} MiB") for fmt, n, b in summary],
        ("resident weights", f"{sum(b for _, _, b in summary) / 2**20:.1f} MiB"),
        (
            "KV cache",
            f"{st.num_blocks} blocks x {bs} tokens = {st.num_blocks * bs} tokens, "
            f"{str(kv_dtype(engine.config)).removeprefix('torch.')}",
        ),
        ("boot", _boot(engine.boot)),
        ("compile cache", _compile_cache(engine.boot.compile_cache)),
        ("torch.compile", compiled["summary"] if compiled else NOT_COMPILED),
        ("CUDA graphs", _graphs(engine.boot.capture)),
    ]


def _boot(boot: BootReport) -> str:
    phases = ", ".join(f"{name.replace('_', ' ')} {s:.1f} s" for name, s in boot.phases_s.items())
    return f"{boot.boot_s:.1f} s ({phases})"


def _compile_cache(entry: CompileCacheEntry | None) -> str:
    if entry is None:
        return NOT_COMPILED
    waited = f", waited {entry.waited_s:.1f} s for another process" if entry.waited_s else ""
    return f"{entry.path} ({'reused' if entry.reused else 'new'}{waited})"


def _graphs(st: CaptureStats) -> str:
    if not st.graphs:
        return "none captured"
    return (
        f"{st.graphs} captured in {st.seconds:.1f} s, {st.memory_bytes / 2**30:.2f} GiB "
        f"(reserved {st.reserved_bytes / 2**30:.2f} GiB)"
    )


def _planned_cache(preview: EnginePreview) -> str:
    if preview.plan.mode != 3:
        return NOT_COMPILED
    path = entry_for_plan(
        preview.plan.to_dict(),
        keyed_model(preview.source, preview.config, preview.attn_backend),
        preview.config.dtype,
        preview.device,
    )
    return (
        f"{path} ({'sealed: boot reuses it' if is_sealed(path) else 'not built: boot compiles it'})"
    )


def run(args: argparse.Namespace) -> int:
    config = engine_config(args.model, **engine_kwargs(args))
    if args.plan_only:
        p = preview_engine(config)
        rows = _model_rows(p.source.path, p.source.config, p.source.load_tokenizer())
        attention = p.attn_backend
        rows += _config_rows(p.config, p.device, p.max_model_len,
                             attention.describe(), attention.graph_support.value)  # fmt: skip
        rows += [("compile cache", _planned_cache(p))]
        plan = p.plan
    else:
        engine = build_engine(config)
        boot = engine.boot
        rows = _model_rows(boot.model_path, engine.model_config, engine.tokenizer)
        rows += _config_rows(engine.config, boot.device, engine.max_model_len,
                             boot.attention_kernels, boot.attention_graph_support)  # fmt: skip
        rows += _boot_rows(engine)
        plan = engine.plan
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print()
    print(plan_table(plan))
    if args.plan_only:
        print(
            "(the plan before boot measures graph memory: with a fixed --kv-cache-memory, boot "
            "may cut the capture sizes to what fits, with a warning)"
        )
    return 0
