"""GGUF reading: llama.cpp's q/k permutation undone, every common tensor type dequantized,
metadata turned into the model config."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.loader.gguf import GGUFSource, dequantize

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
# (type, tolerance relative to the tensor's max magnitude)
TYPES = [(T.F32, 0), (T.F16, 1e-3), (T.BF16, 1e-2), (T.Q8_0, 1e-2), (T.Q4_0, 0.15), (T.Q4_1, 0.1)]


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


def _write(path, hf_model, kind_of) -> None:
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


@pytest.mark.parametrize("kind,tol", TYPES, ids=[t.name for t, _ in TYPES])
def test_tensors_round_trip(tiny_models, tmp_path, kind, tol):
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    path = tmp_path / "tiny.gguf"
    _write(path, hf, lambda name: kind)
    src = GGUFSource(str(path))
    assert src.config.num_layers == 2 and src.config.num_kv_heads == 2
    assert src.config.tie_word_embeddings is False
    ref = hf.state_dict()
    loaded = dict(src.tensors(torch.float32))
    assert set(loaded) == set(ref)
    for name, tensor in loaded.items():
        r = ref[name]
        torch.testing.assert_close(tensor, r, atol=tol * r.abs().max().item() + 1e-7, rtol=0)


def test_gguf_model_logits_match_hf(tiny_models, tmp_path):
    """The whole path (metadata, names, permutation) through kiln's model, F32 weights."""
    from kiln.attention import TorchPagedAttentionBackend
    from kiln.models import build_model
    from kiln.models.weights import load_weights
    from tests.helpers import make_engine

    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"]).eval()
    path = tmp_path / "tiny.gguf"
    _write(path, hf, lambda name: T.F32)
    engine = make_engine(tiny_models["llama"])  # the runner drives a GGUF-loaded model below
    src = GGUFSource(str(path))
    model = build_model(src.config, TorchPagedAttentionBackend())
    load_weights(model, src.tensors(torch.float32))
    model.finalize(torch.device("cpu"))
    engine.runner.model = model
    engine.runner.allocate_kv_cache(engine.blocks.num_blocks, torch.float32)
    ids = [5, 17, 300, 4000, 12, 9]
    engine.add_request("g", ids, __import__("kiln").SamplingParams(temperature=0, max_tokens=1))
    rows = []
    engine.logits_observer = lambda seqs, logits: rows.append(logits[0].clone())
    while engine.has_unfinished_requests():
        engine.step()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(rows[0], ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def _k_quant_file(tmp_path):
    """One 256-value block each of Q4_K and Q6_K, built by hand from the ggml block layouts."""
    # Q4_K: d=0.5, dmin=0.25 (fp16); 12 bytes of 6-bit scales/mins: every sub-block scale 2, min 1;
    # 128 bytes of 4-bit quants, all 3. Value = d * scale * q - dmin * min = 0.5*2*3 - 0.25 = 2.75
    q4k = np.zeros(144, dtype=np.uint8)
    q4k[0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    q4k[2:4] = np.frombuffer(np.float16(0.25).tobytes(), np.uint8)
    q4k[4:8] = 2  # scales of sub-blocks 0-3
    q4k[8:12] = 1  # mins of sub-blocks 0-3
    q4k[12:16] = 0x12  # sub-blocks 4-7: scale in the low nibble (2), min in the high (1)
    q4k[16:] = 0x33
    # Q6_K: 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, d (fp16).
    # q = 40 everywhere (low nibble 8, high bits 2); value = d * scale * (q - 32) = 0.5 * 3 * 8 = 12
    q6k = np.zeros(210, dtype=np.uint8)
    q6k[0:128] = 0x88
    q6k[128:192] = 0b10101010
    q6k[192:208] = 3
    q6k[208:210] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_tensor("q4k", q4k[None, :], raw_dtype=T.Q4_K)
    w.add_tensor("q6k", q6k[None, :], raw_dtype=T.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(tmp_path / "k.gguf"))


def test_k_quants_dequantize_to_hand_computed_values(tmp_path):
    reader = _k_quant_file(tmp_path)
    tensors = {t.name: dequantize(t) for t in reader.tensors}
    np.testing.assert_allclose(tensors["q4k"], np.full((1, 256), 2.75, np.float32))
    np.testing.assert_allclose(tensors["q6k"], np.full((1, 256), 12.0, np.float32))


def test_unsupported_tensor_type_is_named(tmp_path):
    from kiln.errors import ModelLoadError

    w = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    w.add_tensor("iq", np.zeros((1, 66), np.uint8), raw_dtype=T.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = gguf.GGUFReader(str(tmp_path / "iq.gguf")).tensors[0]
    with pytest.raises(ModelLoadError, match=r"IQ2_XXS.*Q4_K"):
        dequantize(t)
