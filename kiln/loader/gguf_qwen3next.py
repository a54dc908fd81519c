"""llama.cpp's `qwen3next` GGUF files (Qwen3-Next) read back into HF's Qwen3-Next tensors.

llama.cpp's converter (convert_hf_to_gguf.py, `Qwen3NextModel`) changes the model on the way:
- the zero-centred RMSNorm weights (x * (1 + w)) are stored plus one; the Gated DeltaNet's own
  gated norm (`ssm_norm`) is not;
- `A_log` is stored as `ssm_a` = -exp(A_log);
- the depthwise convolution [channels, 1, kernel] loses its middle dimension;
- `in_proj_qkvz`, whose rows HF groups per key head ([q_g | k_g | v_g | z_g] for each key
  head g, v_g and z_g holding that head's num_value_heads / num_key_heads value heads), is split
  into `attn_qkv` (all q, then all k, then all v) and `attn_gate` (all z). Files from before
  that split store it whole, in HF's order, as `ssm_in`;
- `post_attention_layernorm` is `post_attention_norm`; the shared expert is `*_shexp`;
- the multi-token-prediction layers are dropped.
The metadata names the layer pattern by `full_attention_interval` (a layer is full attention
when its index + 1 is a multiple; 4 when absent) and the DeltaNet's shape by `ssm.*`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from kiln.layers.packed import Int4Codes, QuantizedTensor, cat_rows
from kiln.models.config import LinearAttentionConfig

Tensor = torch.Tensor | QuantizedTensor

LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",  # q and its gate, per head, as HF's
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ssm_in.weight": "linear_attn.in_proj_qkvz.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# the split halves of in_proj_qkvz, joined again once both have arrived
SPLIT_QKVZ = {"attn_qkv.weight": "qkv", "attn_gate.weight": "z"}
PLUS_ONE_NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "model.norm")


def hybrid_config(field, block_count: int, head_dim: int) -> dict[str, Any]:
    """The ModelConfig fields of a qwen3next file's metadata (`field(key)` reads one)."""
    interval = field("full_attention_interval") or 4
    value_heads = field("ssm.time_step_rank")
    linear = LinearAttentionConfig(
        num_key_heads=field("ssm.group_count"),
        num_value_heads=value_heads,
        key_head_dim=field("ssm.state_size"),
        value_head_dim=field("ssm.inner_size") // value_heads,
        conv_kernel=field("ssm.conv_kernel"),
    )
    types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                  for i in range(block_count))  # fmt: skip
    rotary = field("rope.dimension_count") or head_dim
    return {
        "layer_types": types,
        "linear_attention": linear,
        "partial_rotary_factor": rotary / head_dim,
        "attention_output_gate": True,
    }


class Qwen3NextTensors:
    """Turns the generic reader's HF-named tensors of a qwen3next file into HF's own."""

    def __init__(self, linear: LinearAttentionConfig) -> None:
        self.linear = linear
        self.halves: dict[str, dict[str, Tensor]] = {}  # layer prefix -> qkv / z so far

    def join(self, name: str, t: Tensor) -> Iterator[tuple[str, Tensor]]:
        """Every tensor as it is, but the halves of in_proj_qkvz: nothing for the first, the
        joined tensor for the second."""
        prefix, _, leaf = name.rpartition(".")
        if leaf not in SPLIT_QKVZ.values():
            yield name, t
            return
        halves = self.halves.setdefault(prefix, {})
        halves[leaf] = t
        if len(halves) == 2:
            del self.halves[prefix]
            yield f"{prefix}.in_proj_qkvz.weight", self._join(halves["qkv"], halves["z"])

    def dense(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A float32 tensor as HF stores it (before it takes the model's dtype: the norms'
        stored 1 + w would lose w's low bits in bf16)."""
        if name.endswith(".weight") and name.removesuffix(".weight").endswith(PLUS_ONE_NORMS):
            return t - 1
        if name.endswith("A_log"):
            return torch.log(-t.float()).to(t.dtype)
        if name.endswith("conv1d.weight") and t.dim() == 2:
            return t.unsqueeze(1)
        if name.endswith("shared_expert_gate.weight") and t.dim() == 1:
            return t.unsqueeze(0)
        return t

    def _join(self, qkv: Tensor, z: Tensor) -> Tensor:
        """HF's in_proj_qkvz rows from the concatenation [qkv; z]: per key head g, its q, k, v
        and z rows."""
        c = self.linear
        dk, r_dv = c.key_head_dim, c.num_value_heads // c.num_key_heads * c.value_head_dim
        k0, v0, z0 = c.num_key_heads * dk, 2 * c.num_key_heads * dk, qkv.shape[0]
        order = []
        for g in range(c.num_key_heads):
            for start, size in ((g * dk, dk), (k0 + g * dk, dk), (v0 + g * r_dv, r_dv),
                                (z0 + g * r_dv, r_dv)):  # fmt: skip
                order.extend(range(start, start + size))
        return _rows(_cat(qkv, z), torch.tensor(order))


def _cat(a: Tensor, b: Tensor) -> Tensor:
    """[a; b], kept quantized where both halves share one 4-bit form."""
    quantized = isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor)
    if quantized and (len(a.planes), a.group_size) == (len(b.planes), b.group_size):
        return cat_rows([a, b])
    return torch.cat([_as_dense(a).float(), _as_dense(b).float()])


def _rows(t: Tensor, index: torch.Tensor) -> Tensor:
    """Rows `index` of a dense or quantized matrix (quantized rows move with their scales)."""
    if isinstance(t, torch.Tensor):
        return t[index]
    planes = [Int4Codes(p.codes[index], p.scale[index], p.zero[index], p.group_size)
              for p in t.planes]  # fmt: skip
    return QuantizedTensor(t.kind, planes)


def _as_dense(t: Tensor) -> torch.Tensor:
    return t.dequantize() if isinstance(t, QuantizedTensor) else t
