"""Tiny GGUF files written from an HF model with the `gguf` package, as llama.cpp's converter
writes them (Llama's q/k rows permuted for its rotary layout; a Qwen3-MoE's experts stacked per
projection), one tensor type per weight."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
}


def _gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    if rest.startswith("mlp.stacked_"):  # mlp.stacked_up -> ffn_up_exps
        return f"blk.{layer}.ffn_{rest.removeprefix('mlp.stacked_')}_exps.weight"
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER[module]}.{leaf}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k weights."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _hf_tensors(hf_model):
    """The state dict as llama.cpp's converter sees it: a Qwen3-MoE layer's experts (stacked
    `gate_up_proj` [E, 2I, H] and `down_proj` in transformers' memory) as three stacks."""
    for name, tensor in hf_model.state_dict().items():
        data = tensor.float().numpy()
        if name.endswith("experts.gate_up_proj"):
            gate, up = np.split(data, 2, axis=1)
            yield name.replace("experts.gate_up_proj", "stacked_gate"), gate
            yield name.replace("experts.gate_up_proj", "stacked_up"), up
        elif name.endswith("experts.down_proj"):
            yield name.replace("experts.down_proj", "stacked_down"), data
        else:
            yield name, data


def _moe_metadata(w: gguf.GGUFWriter, cfg) -> None:
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_weights_norm(cfg.norm_topk_prob)


def write_gguf(
    path, hf_model, kind_of: Callable[[str], gguf.GGMLQuantizationType], arch: str = "llama"
) -> None:
    """arch: "llama" (q/k permuted) or "qwen3moe" (a Qwen3-MoE model)."""
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "qwen3moe":
        _moe_metadata(w, cfg)
    for name, data in _hf_tensors(hf_model):
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = _llama_cpp_permute(data, heads)
        kind = kind_of(name) if data.ndim >= 2 else T.F32
        q = data if kind == T.F32 else gguf.quants.quantize(data, kind)
        w.add_tensor(_gguf_name(name), q, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
