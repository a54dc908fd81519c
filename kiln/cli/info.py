"""`kiln info`: what the model is and how the engine resolved its configuration."""

from __future__ import annotations

import argparse

from kiln.cli.engine_args import engine_kwargs


def _rows(engine) -> list[tuple[str, str]]:
    m = engine.model_config
    st = engine.stats()
    bs = engine.config.cache.block_size
    return [
        ("model", engine.source.path),
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
        ("chat template", "yes" if engine.tokenizer.has_chat_template else "no"),
        ("device / dtype", f"{engine.device} / {engine.config.dtype}"),
        ("max_model_len", str(engine.max_model_len)),
        ("max_num_seqs", str(engine.config.scheduler.max_num_seqs)),
        ("max_num_batched_tokens", str(engine.config.scheduler.max_num_batched_tokens)),
        ("KV cache", f"{st.num_blocks} blocks x {bs} tokens = {st.num_blocks * bs} tokens"),
        ("prefix caching", str(engine.config.cache.enable_prefix_caching)),
        (
            "attention backend",
            f"{engine.attn_backend.name} (CUDA graphs: {engine.attn_backend.graph_support.value})",
        ),
        ("boot", _boot(engine)),
        ("compile cache", _compile_cache(engine)),
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
        return "none (mode 0 compiles nothing)"
    waited = f", waited {entry.waited_s:.1f} s for another process" if entry.waited_s else ""
    return f"{entry.path} ({'reused' if entry.reused else 'new'}{waited})"


def _graphs(engine) -> str:
    st = engine.capture
    if not st.graphs:
        return "none captured"
    return (
        f"{st.graphs} captured in {st.seconds:.1f} s, {st.memory_bytes / 2**30:.2f} GiB "
        f"(reserved {st.reserved_bytes / 2**30:.2f} GiB)"
    )


def print_info(args: argparse.Namespace) -> int:
    from kiln.engine import LLMEngine
    from kiln.llm import engine_config

    engine = LLMEngine(engine_config(args.model, **engine_kwargs(args)))
    rows = _rows(engine)
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print()
    print(engine.plan.table())
    return 0
