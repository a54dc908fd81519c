"""Write a random-weight GGUF with a real model's shapes, for speed comparisons where no real
file of that size is on the machine: kiln and llama.cpp both load it.

    python benchmarks/make_random_gguf.py --shape llama-3.2-1b --type Q4_0 --out /tmp/l1b-q4_0.gguf
    python benchmarks/make_random_gguf.py --shape llama-3.2-1b --type Q4_K --out /tmp/l1b-q4_k.gguf
    python benchmarks/make_random_gguf.py --shape llama-3.2-1b --type Q4_K_M --out /tmp/l1b-km.gguf
    python benchmarks/make_random_gguf.py --shape llama-3.2-1b --type Q5_K_M --out /tmp/l1b-5.gguf
    python benchmarks/make_random_gguf.py --shape qwen3-0.6b --type Q4_0 --out /tmp/q3.gguf \
        --hf-dir /tmp/q3-hf   # the long-context model (40,960 positions), also as an HF directory
    python benchmarks/make_random_gguf.py --shape qwen3-30b-a3b-4-layers --type Q4_0 \
        --out /tmp/moe.gguf   # 4 of Qwen3-30B-A3B's mixture-of-experts layers (qwen3moe)
    python benchmarks/make_random_gguf.py --shape qwen3-30b-a3b --type Q4_K_M \
        --out /tmp/q3-30b-km.gguf   # all 48 of its layers: 17.1 GiB

`Q4_K_M` and `Q5_K_M` mix types as llama.cpp's recipes do: Q6_K for the tied embedding (the
head), and for attn_v and ffn_down (a mixture-of-experts file's down experts too) in the layers
its `use_more_bits` picks (the first and last eighth, every third between), Q4_K (Q5_K) for the
rest.

Every matrix (the tied embedding too) is random blocks of the chosen type, scaled so weights have
a standard deviation near 0.02 and the activations stay finite; norms are ones. The embedding rows
of control tokens are zeros, so greedy decoding never ends a timed answer early. The tokenizer is
the embedded SmolLM2 file's (its metadata copied), its vocabulary padded with unused tokens to
the model's size. The answers are noise: a profile for this file has no probes.

`qwen3-0.6b` is Qwen3-0.6B's architecture and shapes (q/k norms, tied embedding, 40,960
positions): the long-context model of the benchmarks. `--hf-dir` also writes the same weights,
dequantized by transformers' GGUF reader, as an HF directory in bf16 (with the tokenizer)."""

from __future__ import annotations

import argparse

import gguf
import numpy as np

from kiln.default_model import default_model_path
from kiln.loader.gguf_file import GGUFFile

SHAPES = {
    "llama-3.2-1b": dict(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8,
                         head_dim=64, vocab=128256, theta=500000.0, context=8192),
    "qwen3-0.6b": dict(arch="qwen3", layers=28, hidden=1024, intermediate=3072, heads=16,
                       kv_heads=8, head_dim=128, vocab=151936, theta=1000000.0, context=40960,
                       qk_norm=True, eps=1e-6),
    "qwen3-0.6b-shapes-llama": dict(layers=28, hidden=1024, intermediate=3072, heads=16,
                                    kv_heads=8, head_dim=128, vocab=151936, theta=1000000.0,
                                    context=32768),
    # Qwen3-30B-A3B's layers (128 experts, top 8, expert intermediate 768), 4 of its 48
    "qwen3-30b-a3b-4-layers": dict(arch="qwen3moe", layers=4, hidden=2048, intermediate=6144,
                                   heads=32, kv_heads=4, head_dim=128, vocab=151936,
                                   theta=1000000.0, context=40960, qk_norm=True, eps=1e-6,
                                   experts=128, top_k=8, expert_intermediate=768),
    # the whole model: 48 layers (a Q4_K_M file of it: 17.1 GiB)
    "qwen3-30b-a3b": dict(arch="qwen3moe", layers=48, hidden=2048, intermediate=6144, heads=32,
                          kv_heads=4, head_dim=128, vocab=151936, theta=1000000.0,
                          context=40960, qk_norm=True, eps=1e-6, experts=128, top_k=8,
                          expert_intermediate=768),
}  # fmt: skip
T = gguf.GGMLQuantizationType
TARGET_STD = 0.02


def _q4_0(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    blocks = rng.integers(0, 256, (n, k // 32, 18), dtype=np.uint8)
    d = np.full((n, k // 32), TARGET_STD / 4.6, dtype=np.float16)  # std of (q - 8) is 4.6
    blocks[..., 0:2] = d.view(np.uint8).reshape(n, k // 32, 2)
    return blocks.reshape(n, -1)


def _q4_k(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    d = TARGET_STD / (31.5 * 4.6)  # six-bit scales average 31.5
    for at, value in ((0, d), (2, 7.5 * d)):  # dmin centres the codes' mean (7.5) on zero
        field = np.full((n, k // 256), value, dtype=np.float16)
        blocks[..., at : at + 2] = field.view(np.uint8).reshape(n, k // 256, 2)
    return blocks.reshape(n, -1)


def _q5_k(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    blocks = rng.integers(0, 256, (n, k // 256, 176), dtype=np.uint8)
    d = TARGET_STD / (31.5 * 9.2)  # six-bit scales average 31.5; std of q (0..31) is 9.2
    for at, value in ((0, d), (2, 15.5 * d)):  # dmin centres the codes' mean (15.5) on zero
        field = np.full((n, k // 256), value, dtype=np.float16)
        blocks[..., at : at + 2] = field.view(np.uint8).reshape(n, k // 256, 2)
    return blocks.reshape(n, -1)


def _q6_k(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    blocks = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    blocks[..., 192:208] = 64  # the int8 scales per 16 columns
    d = np.full((n, k // 256), TARGET_STD / (18.5 * 64), dtype=np.float16)  # std of q - 32: 18.5
    blocks[..., 208:210] = d.view(np.uint8).reshape(n, k // 256, 2)
    return blocks.reshape(n, -1)


MAKERS = {"Q4_0": _q4_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}  # llama.cpp's recipes: their base type


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M writes in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _kind_of(kind: str, name: str, layers: int) -> str:
    """The type `name` gets in a file of `kind` (Q4_K_M, Q5_K_M: llama.cpp's mixes)."""
    if kind not in MIXES:
        return kind
    if name == "token_embd.weight":
        return "Q6_K"
    parts = name.split(".")  # ffn_down_exps too: llama.cpp matches "ffn_down" in the name
    if parts[2] in ("attn_v", "ffn_down", "ffn_down_exps") and _more_bits(int(parts[1]), layers):
        return "Q6_K"
    return MIXES[kind]


def _copy_tokenizer(writer: gguf.GGUFWriter, vocab: int) -> list[int]:
    """The embedded file's tokenizer, padded to `vocab`; returns its control tokens' ids."""
    source = GGUFFile(default_model_path()).fields
    tokens = list(source["tokenizer.ggml.tokens"])
    extra = vocab - len(tokens)
    writer.add_tokenizer_model(source["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(source.get("tokenizer.ggml.pre", "default"))
    writer.add_token_list(tokens + [f"<unused_{i}>" for i in range(extra)])
    # normal tokens, not "unused" ones, which llama.cpp streams as empty text
    writer.add_token_types(list(source["tokenizer.ggml.token_type"]) + [1] * extra)
    writer.add_token_merges(source["tokenizer.ggml.merges"])
    for key, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("padding", writer.add_pad_token_id),
        ("unknown", writer.add_unk_token_id),
    ):
        value = source.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            add(value)  # fmt: skip
    if "tokenizer.chat_template" in source:
        writer.add_chat_template(source["tokenizer.chat_template"])
    return [i for i, kind in enumerate(source["tokenizer.ggml.token_type"]) if kind == 3]


def _experts(w: gguf.GGUFWriter, rng: np.random.Generator, kind: str, layer: int,
             s: dict) -> None:  # fmt: skip
    """A sparse layer as llama.cpp stores it: the router (float32: routing is exact in both
    engines) and each projection's experts stacked, [experts, rows, columns], in the type
    `kind`'s recipe gives it (Q4_K_M: Q6_K down experts in use_more_bits' layers)."""
    experts, hidden, inter = s["experts"], s["hidden"], s["expert_intermediate"]
    router = rng.standard_normal((experts, hidden)).astype(np.float32) * TARGET_STD
    w.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", router)
    for name, n, k in (("ffn_gate_exps", inter, hidden), ("ffn_up_exps", inter, hidden),
                       ("ffn_down_exps", hidden, inter)):  # fmt: skip
        of = _kind_of(kind, f"blk.{layer}.{name}.weight", s["layers"])
        stacked = np.stack([MAKERS[of](rng, n, k) for _ in range(experts)])
        w.add_tensor(f"blk.{layer}.{name}.weight", stacked, raw_dtype=T[of])


def _metadata(w: gguf.GGUFWriter, s: dict) -> None:
    w.add_block_count(s["layers"])
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["intermediate"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_freq_base(s["theta"])
    w.add_layer_norm_rms_eps(s.get("eps", 1e-5))
    w.add_vocab_size(s["vocab"])
    if s.get("experts"):
        w.add_expert_count(s["experts"])
        w.add_expert_used_count(s["top_k"])
        w.add_expert_feed_forward_length(s["expert_intermediate"])
        w.add_expert_weights_norm(True)


def write(shape: str, kind: str, out: str, seed: int = 0) -> None:
    s, rng = SHAPES[shape], np.random.default_rng(seed)
    # tensors spooled to a temporary file as they are made: a 48-layer MoE file is 18 GB
    w = gguf.GGUFWriter(out, s.get("arch", "llama"), use_temp_file=True)
    w.add_name(f"random {shape} {kind}")
    _metadata(w, s)
    control = _copy_tokenizer(w, s["vocab"])
    hidden, q_dim, kv_dim = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]

    def matrix(name: str, n: int, k: int) -> None:
        of = _kind_of(kind, name, s["layers"])
        w.add_tensor(name, MAKERS[of](rng, n, k), raw_dtype=T[of])

    # the tied head's rows of control tokens (end of text, end of turn) are zeros: their logit
    # is 0 while the noise's largest is far above, so no engine stops early on a random EOS
    head = _kind_of(kind, "token_embd.weight", s["layers"])
    embedding = MAKERS[head](rng, s["vocab"], hidden)
    embedding[control] = 0
    w.add_tensor("token_embd.weight", embedding, raw_dtype=T[head])
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(s["layers"]):
        for name, n, k in (("attn_q", q_dim, hidden), ("attn_k", kv_dim, hidden),
                           ("attn_v", kv_dim, hidden), ("attn_output", hidden, q_dim)):  # fmt: skip
            matrix(f"blk.{i}.{name}.weight", n, k)
        if s.get("experts"):
            _experts(w, rng, kind, i, s)
        else:
            for name, n, k in (("ffn_gate", s["intermediate"], hidden),
                               ("ffn_up", s["intermediate"], hidden),
                               ("ffn_down", hidden, s["intermediate"])):  # fmt: skip
                matrix(f"blk.{i}.{name}.weight", n, k)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, dtype=np.float32))
        for norm in ("attn_q_norm", "attn_k_norm") if s.get("qk_norm") else ():
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(s["head_dim"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_hf_directory(gguf_path: str, out_dir: str) -> None:
    """The GGUF's weights and tokenizer as an HF directory (bf16 safetensors), read back by
    transformers' own GGUF loader: kiln's HF path then serves the same model."""
    import os

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    # save_pretrained refuses a model read from a GGUF (it counts as quantized): the weights
    # are plain bf16 tensors by now, so they are written directly, the config without the flag
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    os.makedirs(out_dir, exist_ok=True)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="llama-3.2-1b")
    parser.add_argument(
        "--type", choices=["Q4_0", "Q4_K", "Q5_K", "Q4_K_M", "Q5_K_M"], default="Q4_0"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--hf-dir", help="also write the weights as an HF directory here")
    args = parser.parse_args()
    write(args.shape, args.type, args.out)
    print(f"wrote {args.out}")
    if args.hf_dir:
        write_hf_directory(args.out, args.hf_dir)
        print(f"wrote {args.hf_dir}")


if __name__ == "__main__":
    main()
