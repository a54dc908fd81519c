"""`kiln info`: what the model is and how the engine resolved its configuration; with
`--plan-only`, what it would resolve to, without loading weights, compiling or capturing."""

from __future__ import annotations

import argparse

from kiln.cli.engine_args import engine_kwargs

NOT_COMPILED = "none (mode 0 compiles nothing)"  # the compile cache and torch.compile rows


def _model_rows(source, tokenizer) -> list[tuple[str, str]]:
    m = source.config
    return [
        ("model", source.path),
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
        ("chat template", "yes" if tokenizer.has_chat_template else "no"),
    ]


def _config_rows(config, device, max_model_len: int, backend) -> list[tuple[str, str]]:
    return [
        ("device / dtype", f"{device} / {config.dtype}"),
        ("max_model_len", str(max_model_len)),
        ("max_num_seqs", str(config.scheduler.max_num_seqs)),
        ("max_num_batched_tokens", str(config.scheduler.max_num_batched_tokens)),
        ("prefix caching", str(config.cache.enable_prefix_caching)),
        ("attention backend", f"{backend.name} (CUDA graphs: {backend.graph_support.value})"),
    ]


def _boot_rows(engine) -> list[tuple[str, str]]:
    st = engine.stats()
    bs = engine.config.cache.block_size
    return [
        ("KV cache", f"{st.num_blocks} blocks x {bs} tokens = {st.num_blocks * bs} tokens"),
        ("boot", _boot(engine)),
        ("compile cache", _compile_cache(engine)),
        ("torch.compile", _compilation(engine)),
        ("CUDA graphs", _graphs(engine)),
    ]


def _boot(engine) -> str:
    phases = ", ".join(
        f"{name.replace('_', ' ')} {s:.1f} s" for name, s in engine.boot.durations.items()
    )
    return f"{engine.boot_s:.1f} s ({phases})"


def _compile_cache(engine) -> str:
    entry = engine.compile_cache
    if entry is None:
        return NOT_COMPILED
    waited = f", waited {entry.waited_s:.1f} s for another process" if entry.waited_s else ""
    return f"{entry.path} ({'reused' if entry.reused else 'new'}{waited})"


def _compilation(engine) -> str:
    backend = engine.runner.compile_backend
    return backend.stats.summary(engine.plan.backend) if backend else NOT_COMPILED


def _graphs(engine) -> str:
    st = engine.capture
    if not st.graphs:
        return "none captured"
    return (
        f"{st.graphs} captured in {st.seconds:.1f} s, {st.memory_bytes / 2**30:.2f} GiB "
        f"(reserved {st.reserved_bytes / 2**30:.2f} GiB)"
    )


def _planned_cache(preview) -> str:
    from kiln.compilation.cache import entry_for_plan, is_sealed

    if preview.plan.mode != 3:
        return NOT_COMPILED
    path = entry_for_plan(
        preview.plan.to_dict(),
        preview.source.config.to_dict(),
        preview.config.dtype,
        preview.device,
    )
    return (
        f"{path} ({'sealed: boot reuses it' if is_sealed(path) else 'not built: boot compiles it'})"
    )


def print_info(args: argparse.Namespace) -> int:
    from kiln.llm import engine_config

    config = engine_config(args.model, **engine_kwargs(args))
    if args.plan_only:
        from kiln.engine_plan import preview_engine

        p = preview_engine(config)
        rows = _model_rows(p.source, p.source.load_tokenizer())
        rows += _config_rows(p.config, p.device, p.max_model_len, p.attn_backend)
        rows += [("compile cache", _planned_cache(p))]
        plan = p.plan
    else:
        from kiln.engine import LLMEngine

        engine = LLMEngine(config)
        rows = _model_rows(engine.source, engine.tokenizer)
        rows += _config_rows(
            engine.config, engine.device, engine.max_model_len, engine.attn_backend
        )
        rows += _boot_rows(engine)
        plan = engine.plan
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print()
    print(plan.table())
    if args.plan_only:
        print(
            "(the plan before boot measures graph memory: with a fixed --kv-cache-memory, boot "
            "may cut the capture sizes to what fits, with a warning)"
        )
    return 0
