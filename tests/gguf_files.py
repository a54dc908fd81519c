"""Tiny GGUF files written from an HF model with the `gguf` package, as llama.cpp's converter
writes them (q/k rows permuted for its rotary layout), one tensor type per weight."""

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
}


def _gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER[module]}.{leaf}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k weights."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path, hf_model, kind_of: Callable[[str], gguf.GGMLQuantizationType]) -> None:
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), "llama")
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
    for name, tensor in hf_model.state_dict().items():
        data = tensor.float().numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = _llama_cpp_permute(data, heads)
        kind = kind_of(name) if data.ndim == 2 else T.F32
        q = data if kind == T.F32 else gguf.quants.quantize(data, kind)
        w.add_tensor(_gguf_name(name), q, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
