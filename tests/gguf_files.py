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


def _permuted(tensors, cfg):
    for name, data in tensors:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = _llama_cpp_permute(data, heads)
        yield name, data


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
    w.add_expert_weights_norm(getattr(cfg, "norm_topk_prob", True))


QWEN3NEXT_LAYER = {
    "linear_attn.in_proj_ba": "ssm_ba",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "post_attention_layernorm": "post_attention_norm",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}


def _qwen3next_tensors(hf_model):
    """What llama.cpp's converter makes of a Qwen3-Next state dict, as (HF-style name or GGUF
    name, data): norms + 1 (not the DeltaNet's gated norm), A_log as -exp(A_log), the
    convolution squeezed, in_proj_qkvz split into all q, k, v (`attn_qkv`) and all z
    (`attn_gate`) from HF's per-key-head groups."""
    cfg = hf_model.config
    nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    r_dv = cfg.linear_num_value_heads // nk * cfg.linear_value_head_dim
    for name, data in _hf_tensors(hf_model):
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        module = name.split(".", 3)[-1].rsplit(".", 1)[0] if layer else None
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            data = data + 1
        if name.endswith("A_log"):
            yield f"blk.{layer}.ssm_a", -np.exp(data)
        elif name.endswith("dt_bias"):
            yield f"blk.{layer}.ssm_dt.bias", data
        elif name.endswith("in_proj_qkvz.weight"):
            groups = data.reshape(nk, 2 * dk + 2 * r_dv, -1)
            q, k, v, z = np.split(groups, [dk, 2 * dk, 2 * dk + r_dv], axis=1)
            hidden = data.shape[1]
            qkv = np.concatenate([t.reshape(-1, hidden) for t in (q, k, v)])
            yield f"blk.{layer}.attn_qkv.weight", qkv
            yield f"blk.{layer}.attn_gate.weight", z.reshape(-1, hidden)
        elif module in QWEN3NEXT_LAYER:
            squeeze = name.endswith("conv1d.weight")
            yield f"blk.{layer}.{QWEN3NEXT_LAYER[module]}.weight", data[:, 0] if squeeze else data
        else:
            yield name, data


QWEN35_LINEAR = {"in_proj_qkv": "attn_qkv", "in_proj_z": "attn_gate", "in_proj_b": "ssm_beta",
                 "in_proj_a": "ssm_alpha"}  # fmt: skip
NEXTN = {
    "mtp.fc.weight": "nextn.eh_proj",
    "mtp.pre_fc_norm_embedding.weight": "nextn.enorm",
    "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm",
    "mtp.norm.weight": "nextn.shared_head_norm",
}


def _tiled(data: np.ndarray, start: int, head_dim: int, cfg, axis: int = 0) -> np.ndarray:
    """The converter's Qwen3.5 value-head reorder along `axis` from `start`: the file's slot
    j * num_key_heads + g holds HF's head g * r + j."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    r = nv // nk
    slots = np.arange(nv)
    hf_head = (slots % nk) * r + slots // nk
    index = np.concatenate([np.arange(start), (start + hf_head[:, None] * head_dim
                                               + np.arange(head_dim)).reshape(-1)])  # fmt: skip
    return np.take(data, index, axis=axis)


def _qwen35_tensors(hf_model, mtp: dict | None):
    """What llama.cpp's converter makes of a Qwen3.5 text model (and its MTP head, as a block
    after the model's): Qwen3-Next's changes with the separate projections, every value-head
    axis tiled."""
    cfg = hf_model.config
    conv_qk, dv = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_value_head_dim
    state = dict(_hf_tensors(hf_model))
    n = cfg.num_hidden_layers
    for name, t in (mtp or {}).items():
        state[name.replace("mtp.layers.0.", f"model.layers.{n}.")] = t.float().numpy()
    for name, data in state.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        module = name.split(".", 3)[-1].rsplit(".", 1)[0] if layer else None
        # the converter renames the MTP norms (enorm, hnorm, shared_head.norm) before its
        # "norm.weight" test, so they get their + 1 too
        zero_centred = name.endswith("norm.weight") or name.startswith("mtp.pre_fc_norm")
        if zero_centred and not name.endswith("linear_attn.norm.weight"):
            data = data + 1
        leaf = module.removeprefix("linear_attn.") if module else None
        if name in NEXTN:
            yield f"blk.{n}.{NEXTN[name]}.weight", data
        elif name.endswith("A_log"):
            yield f"blk.{layer}.ssm_a", -np.exp(_tiled(data, 0, 1, cfg))
        elif name.endswith("dt_bias"):
            yield f"blk.{layer}.ssm_dt.bias", _tiled(data, 0, 1, cfg)
        elif leaf in QWEN35_LINEAR:
            head = dv if leaf in ("in_proj_qkv", "in_proj_z") else 1
            start = conv_qk if leaf == "in_proj_qkv" else 0
            yield f"blk.{layer}.{QWEN35_LINEAR[leaf]}.weight", _tiled(data, start, head, cfg)
        elif module == "linear_attn.conv1d":
            yield f"blk.{layer}.ssm_conv1d.weight", _tiled(data[:, 0], conv_qk, dv, cfg)
        elif module == "linear_attn.out_proj":
            yield f"blk.{layer}.ssm_out.weight", _tiled(data, 0, dv, cfg, axis=1)
        elif module in QWEN3NEXT_LAYER:
            yield f"blk.{layer}.{QWEN3NEXT_LAYER[module]}.weight", data
        else:
            yield name, data


def _qwen3next_metadata(w: gguf.GGUFWriter, cfg) -> None:
    if getattr(cfg, "num_experts", 0):
        _moe_metadata(w, cfg)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(cfg.layer_types.index("full_attention") + 1)
    rotary = cfg.rope_parameters.get("partial_rotary_factor", 0.25)
    w.add_rope_dimension_count(int(cfg.head_dim * rotary))


def _fused(tensors):
    """llama.cpp's --fuse-qkv and --fuse-gate-up-exps: each layer's q, k and v (after the
    permutation) as `attn_qkv`, one after another along the rows (weights and biases), and its
    stacked experts' gate and up as `ffn_gate_up_exps`, gate rows first in each expert."""
    held: dict[str, np.ndarray] = {}
    groups = {"attn_qkv": ("q_proj", "k_proj", "v_proj"), "ffn_gate_up_exps": ("stacked_gate",
              "stacked_up")}  # fmt: skip
    for name, data in tensors:
        group = next((g for g, parts in groups.items() if any(f".{p}" in name for p in parts)),
                     None)  # fmt: skip
        if group is None or not name.startswith("model.layers."):
            yield name, data
            continue
        held[name] = data
        layer, leaf = name.split(".")[2], name.rsplit(".", 1)[1]
        leaf = leaf if leaf in ("weight", "bias") else "weight"  # the stacks have no leaf
        parts = [n for p in groups[group] for n in held if f".{layer}." in n and f".{p}" in n
                 and n.endswith(leaf if leaf == "bias" else ("weight", p))]  # fmt: skip
        if len(parts) == len(groups[group]):
            axis = 1 if group == "ffn_gate_up_exps" else 0
            yield f"blk.{layer}.{group}.{leaf}", np.concatenate([held.pop(n) for n in parts], axis)


def quantize(data: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """float32 [..., N, K] as GGUF blocks of `kind` (by rows): the gguf package's quantizer, and
    for Q6_K, Q5_K and Q4_K (which it lacks) `quantize_q6_k` and `quantize_q5_k`."""
    if kind not in (T.Q6_K, T.Q5_K, T.Q4_K):
        return gguf.quants.quantize(data, kind)
    rows = data.reshape(-1, data.shape[-1])
    if kind == T.Q6_K:
        blocks = quantize_q6_k(rows)
    else:
        blocks = quantize_q5_k(rows, 5 if kind == T.Q5_K else 4)
    return blocks.reshape(*data.shape[:-1], -1)


def _steps(v: np.ndarray, step: np.ndarray, top: int) -> np.ndarray:
    """round(v / step) in 0..top as uint8 (0 where the step is 0)."""
    q = np.where(step > 0, np.round(v / np.where(step > 0, step, 1)), 0)
    return q.clip(0, top).astype(np.uint8)


def quantize_q5_k(data: np.ndarray, bits: int = 5) -> np.ndarray:
    """float32 [N, K] (K a multiple of 256) as Q5_K blocks [N, K / 256 * 176] (`bits` 4: Q4_K's
    [N, K / 256 * 144]), written from the format as llama.cpp's dequantizer reads it: per 256
    columns d and dmin (fp16), 12 bytes of six-bit scales and mins, 32 bytes of top bits (Q5_K
    only), 128 of low nibbles; w = d sc q - dmin mn per 32 columns. Each 32 columns span
    [min(x, 0), max(x)] in 2**bits - 1 steps (round to nearest, not llama.cpp's search: any
    valid block serves a test)."""
    n, k = data.shape
    top = 2**bits - 1
    x = data.reshape(n, k // 256, 8, 32).astype(np.float32)
    low = np.minimum(x.min(-1), 0)  # [n, b, 8]
    step, floor = (x.max(-1) - low) / top, -low
    d, dmin = ((v.max(-1, keepdims=True) / 63).astype(np.float16) for v in (step, floor))
    sc, mn = (_steps(v, f.astype(np.float32), 63) for v, f in ((step, d), (floor, dmin)))
    scale = (d.astype(np.float32) * sc)[..., None]
    shifted = x + (dmin.astype(np.float32) * mn)[..., None]
    q = _steps(shifted, scale, top)  # [n, b, 8, 32]
    packed_scales = np.concatenate([sc[..., :4] | (sc[..., 4:] >> 4) << 6,
                                    mn[..., :4] | (mn[..., 4:] >> 4) << 6,
                                    (sc[..., 4:] & 15) | (mn[..., 4:] & 15) << 4], -1)  # fmt: skip
    qh = sum((q[..., s, :] >> 4) << s for s in range(8)).astype(np.uint8)  # [n, b, 32]
    lo = (q & 15).reshape(n, k // 256, 4, 2, 32)
    qs = (lo[..., 0, :] | lo[..., 1, :] << 4).reshape(n, k // 256, 128)
    high = [qh] if bits == 5 else []
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed_scales, *high, qs], -1)
    return blocks.reshape(n, -1)


def quantize_q6_k(data: np.ndarray) -> np.ndarray:
    """float32 [N, K] (K a multiple of 256) as Q6_K blocks [N, K / 256 * 210], written from the
    format as llama.cpp's dequantizer reads it: per 256 columns 128 bytes of low nibbles, 64 of
    2-bit highs, 16 int8 scales (one per 16 columns) and d (fp16); w = d sc (q - 32). Each 16
    columns' scale is their largest magnitude / 31, stored as d times an int8 (round to
    nearest, not llama.cpp's search for the best scale: any valid block serves a test)."""
    n, k = data.shape
    x = data.reshape(n, k // 256, 16, 16).astype(np.float32)
    sub = np.abs(x).max(-1) / 31  # [n, b, 16]
    d = (np.abs(sub).max(-1, keepdims=True) / 127).astype(np.float16)  # [n, b, 1]
    df = d.astype(np.float32)
    sc = np.where(df > 0, np.round(sub / np.where(df > 0, df, 1)), 0).clip(-128, 127)
    step = (df * sc)[..., None]  # [n, b, 16, 1]
    q = np.where(step != 0, np.round(x / np.where(step != 0, step, 1)), 0).clip(-32, 31) + 32
    q = q.astype(np.uint8).reshape(n, k // 256, 2, 128)  # two halves of 128 columns
    lo, hi = q & 15, q >> 4
    ql = np.concatenate(
        [lo[..., :32] | lo[..., 64:96] << 4, lo[..., 32:64] | lo[..., 96:] << 4], -1
    )
    qh = hi[..., :32] | hi[..., 32:64] << 2 | hi[..., 64:96] << 4 | hi[..., 96:] << 6
    blocks = np.concatenate([ql.reshape(n, k // 256, 128), qh.reshape(n, k // 256, 64),
                             sc.astype(np.int8).view(np.uint8), d.view(np.uint8)], -1)  # fmt: skip
    return blocks.reshape(n, -1)


def write_gguf(
    path, hf_model, kind_of: Callable[[str], gguf.GGMLQuantizationType], arch: str = "llama",
    mtp: dict | None = None, fuse: bool = False,
) -> None:  # fmt: skip
    """arch: "llama" (q/k permuted), "qwen3moe" (a Qwen3-MoE model), "qwen3next", "qwen35" or
    "qwen35moe" (`mtp`: a Qwen3.5 MTP head's `mtp.*` tensors, written as llama.cpp does).
    `fuse`: the dense architectures' q/k/v and experts' gate/up fused, as `_fused`."""
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers + (1 if mtp else 0))
    if mtp:
        w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(getattr(cfg, "intermediate_size", None) or cfg.moe_intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "qwen3moe":
        _moe_metadata(w, cfg)
    if arch in ("qwen3next", "qwen35", "qwen35moe"):
        _qwen3next_metadata(w, cfg)
    tensors = (_qwen3next_tensors(hf_model) if arch == "qwen3next"
               else _qwen35_tensors(hf_model, mtp) if arch.startswith("qwen35")
               else _hf_tensors(hf_model))  # fmt: skip
    tensors = _permuted(tensors, cfg) if arch == "llama" else tensors
    for name, data in _fused(tensors) if fuse else tensors:
        # llama.cpp keeps norms, the convolution and the routers in float32
        kind = kind_of(name) if data.ndim >= 2 and "ssm_conv1d" not in name else T.F32
        q = data if kind == T.F32 else quantize(data, kind)
        w.add_tensor(name if name.startswith("blk.") else _gguf_name(name), q, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
