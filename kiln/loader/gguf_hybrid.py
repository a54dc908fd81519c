"""llama.cpp's GGUF files of the hybrid Qwen models, `qwen3next` (Qwen3-Next) and `qwen35` /
`qwen35moe` (Qwen3.5's text models), read back into HF's tensors.

llama.cpp's converter (convert_hf_to_gguf.py, `Qwen3NextModel` and its Qwen3.5 subclasses)
changes the model on the way:
- the zero-centred RMSNorm weights (x * (1 + w)) are stored plus one; the Gated DeltaNet's own
  gated norm (`ssm_norm`) is not;
- `A_log` is stored as `ssm_a` = -exp(A_log); the depthwise convolution [channels, 1, kernel]
  loses its middle dimension; `post_attention_layernorm` is `post_attention_norm`; the shared
  expert is `*_shexp`;
- Qwen3-Next: `in_proj_qkvz`, whose rows HF groups per key head ([q_g | k_g | v_g | z_g] for
  each key head g, v_g and z_g holding its num_value_heads / num_key_heads value heads), is split
  into `attn_qkv` (all q, then all k, then all v) and `attn_gate` (all z); files from before that
  split store it whole, in HF's order, as `ssm_in`. `in_proj_ba` is `ssm_ba`. The MTP layers are
  dropped;
- Qwen3.5: its separate projections are `attn_qkv`, `attn_gate` (z), `ssm_beta` and `ssm_alpha`.
  Where there are more value heads than key heads, every value-head axis (v's rows of
  `attn_qkv` and of the convolution, z, b, a, A_log, dt_bias, the columns of `out_proj`) is
  reordered from HF's grouped order (head g * r + j, r value heads per key head) to a tiled one
  (position j * num_key_heads + g). The MTP layers are kept as extra blocks after the model's
  (`nextn_predict_layers` of them), with the head's own tensors as `nextn.*`.
The metadata names the layer pattern by `full_attention_interval` (a layer is full attention
when its index + 1 is a multiple; 4 when absent) and the DeltaNet's shape by `ssm.*`."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kiln.layers.packed import (
    Int4Codes,
    QuantizedTensor,
    as_int4_plane,
    cat_rows,
    quantized_form,
)
from kiln.models.config import LinearAttentionConfig

Tensor = torch.Tensor | QuantizedTensor

ARCHITECTURES = {
    "qwen3next": "Qwen3NextForCausalLM",
    "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",  # q and its gate, per head, as HF's
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
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
QWEN3NEXT_NAMES = {
    "ssm_in.weight": "linear_attn.in_proj_qkvz.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    # the split halves of in_proj_qkvz, joined again once both have arrived
    "attn_qkv.weight": "linear_attn.qkv",
    "attn_gate.weight": "linear_attn.z",
}
QWEN35_NAMES = {
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
}
NEXTN_NAMES = {  # Qwen3.5's MTP head, in its block
    "nextn.eh_proj.weight": "mtp.fc.weight",
    "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm.weight": "mtp.norm.weight",
}
PLUS_ONE_NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "model.norm",
                  "pre_fc_norm_embedding", "pre_fc_norm_hidden", "mtp.norm")  # fmt: skip


def text_layers(field: Callable[[str], Any]) -> int:
    """The model's own layers: Qwen3.5 files count their MTP blocks in block_count."""
    return field("block_count") - (field("nextn_predict_layers") or 0)


def hybrid_config(field: Callable[[str], Any], arch: str, head_dim: int) -> dict[str, Any]:
    """The ModelConfig fields of a hybrid file's metadata (`field(key)` reads `{arch}.key`)."""
    interval = field("full_attention_interval") or 4
    value_heads = field("ssm.time_step_rank")
    linear = LinearAttentionConfig(
        num_key_heads=field("ssm.group_count"),
        num_value_heads=value_heads,
        key_head_dim=field("ssm.state_size"),
        value_head_dim=field("ssm.inner_size") // value_heads,
        conv_kernel=field("ssm.conv_kernel"),
        grouped_projections=arch == "qwen3next",
    )
    types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                  for i in range(text_layers(field)))  # fmt: skip
    rotary = field("rope.dimension_count") or head_dim
    return {"layer_types": types, "linear_attention": linear, "num_layers": len(types),
            "partial_rotary_factor": rotary / head_dim, "attention_output_gate": True}  # fmt: skip


def tensor_name(
    gguf_name: str, arch: str, num_layers: int, generic: Callable[[str], str | None]
) -> str | None:
    """A hybrid file's tensor under its HF name (None: not a model tensor); the names it shares
    with the other architectures through `generic`. An MTP block (index >= num_layers) is
    `mtp.layers.<i>`."""
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m is None:
        return generic(gguf_name)
    layer, rest = int(m.group(1)), m.group(2)
    if layer >= num_layers and rest in NEXTN_NAMES:
        return NEXTN_NAMES[rest]
    own = {**LAYER_NAMES, **(QWEN3NEXT_NAMES if arch == "qwen3next" else QWEN35_NAMES)}
    name = f"model.layers.{layer}.{own[rest]}" if rest in own else generic(gguf_name)
    if name is not None and layer >= num_layers:
        name = name.replace(f"model.layers.{layer}.", f"mtp.layers.{layer - num_layers}.", 1)
    return name


class HybridTensors:
    """Turns the generic reader's HF-named tensors of a hybrid file into HF's own: `dense` on
    each dense float32 tensor, then `finish` on every tensor in file order."""

    def __init__(self, linear: LinearAttentionConfig) -> None:
        self.linear = linear
        self.halves: dict[str, dict[str, Tensor]] = {}  # layer prefix -> qkv / z so far
        c = linear
        self.heads_per_key = c.num_value_heads // c.num_key_heads

    def dense(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A float32 tensor as HF stores it (before it takes the model's dtype: the norms'
        stored 1 + w would lose w's low bits in bf16)."""
        if name.endswith(".weight") and name.removesuffix(".weight").endswith(PLUS_ONE_NORMS):
            return t - 1
        if name.endswith("A_log"):
            return torch.log(-self._grouped(name, t, 0, 1))
        if name.endswith("conv1d.weight") and t.dim() == 2:
            c = self.linear
            return self._grouped(name, t, 2 * c.num_key_heads * c.key_head_dim, 0).unsqueeze(1)
        if name.endswith("shared_expert_gate.weight") and t.dim() == 1:
            return t.unsqueeze(0)
        return self._value_heads(name, t)

    def finish(self, name: str, t: Tensor) -> Iterator[tuple[str, Tensor]]:
        """Every tensor as HF has it: quantized ones reordered as `dense` reorders dense ones,
        the halves of Qwen3-Next's in_proj_qkvz joined (nothing for the first)."""
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("qkv", "z"):
            halves = self.halves.setdefault(prefix, {})
            halves[leaf] = t
            if len(halves) == 2:
                del self.halves[prefix]
                yield f"{prefix}.in_proj_qkvz.weight", self._join(halves["qkv"], halves["z"])
            return
        yield name, self._value_heads(name, t) if isinstance(t, QuantizedTensor) else t

    def _value_heads(self, name: str, t: Tensor) -> Tensor:
        """Qwen3.5's tiled value-head axes back in HF's grouped order."""
        c = self.linear
        if c.grouped_projections or self.heads_per_key == 1 or ".linear_attn." not in name:
            return t
        leaf = name.rsplit(".linear_attn.", 1)[1]
        if leaf == "in_proj_qkv.weight":
            return self._grouped(name, t, 2 * c.num_key_heads * c.key_head_dim, c.value_head_dim)
        if leaf in ("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "dt_bias"):
            return self._grouped(name, t, 0, c.value_head_dim if "in_proj_z" in leaf else 1)
        if leaf == "out_proj.weight":
            return _columns(t, self._order(0, c.value_head_dim, t.shape[1]))
        return t

    def _grouped(self, name: str, t: Tensor, start: int, head_dim: int) -> Tensor:
        """Rows from `start` on, value heads of `head_dim` (0: the rest of the rows are one
        value_head_dim each), in HF's grouped order; Qwen3-Next's are grouped already."""
        if self.linear.grouped_projections or self.heads_per_key == 1:
            return t
        return _rows(t, self._order(start, head_dim or self.linear.value_head_dim, t.shape[0]))

    def _order(self, start: int, head_dim: int, total: int) -> torch.Tensor:
        """For each HF position, the file's: HF's value head g * r + j is the file's
        j * num_key_heads + g."""
        nk, r = self.linear.num_key_heads, self.heads_per_key
        hf_head = torch.arange(nk * r)
        file_slot = (hf_head % r) * nk + hf_head // r
        values = start + (file_slot[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)
        return torch.cat([torch.arange(start), values, torch.arange(start + len(values), total)])

    def _join(self, qkv: Tensor, z: Tensor) -> Tensor:
        """HF's in_proj_qkvz rows from the concatenation [qkv; z]: per key head g, its q, k, v
        and z rows."""
        c = self.linear
        dk, r_dv = c.key_head_dim, self.heads_per_key * c.value_head_dim
        k0, v0, z0 = c.num_key_heads * dk, 2 * c.num_key_heads * dk, qkv.shape[0]
        order = []
        for g in range(c.num_key_heads):
            for start, size in ((g * dk, dk), (k0 + g * dk, dk), (v0 + g * r_dv, r_dv),
                                (z0 + g * r_dv, r_dv)):  # fmt: skip
                order.extend(range(start, start + size))
        return _rows(_cat(qkv, z), torch.tensor(order))


def _cat(a: Tensor, b: Tensor) -> Tensor:
    """[a; b], kept quantized where both halves share one form (a Q4_K half beside another 4-bit
    format as int4 planes)."""
    if isinstance(a, QuantizedTensor) and isinstance(b, QuantizedTensor):
        for x, y in ((a, b), (as_int4_plane(a), as_int4_plane(b))):
            if quantized_form(x) == quantized_form(y):
                return cat_rows([x, y])
    return torch.cat([_as_dense(a).float(), _as_dense(b).float()])


def _rows(t: Tensor, index: torch.Tensor) -> Tensor:
    """Rows `index` of a dense or quantized tensor (quantized rows move with their scales)."""
    if isinstance(t, torch.Tensor):
        return t[index]
    return QuantizedTensor(t.kind, [p.map_rows(lambda x: x[index]) for p in t.planes])


def _columns(t: Tensor, index: torch.Tensor) -> Tensor:
    """Columns `index` of a matrix; a quantized one stays quantized where the permutation moves
    whole groups, else it is dequantized."""
    if isinstance(t, torch.Tensor):
        return t[:, index]
    exact = t
    t = as_int4_plane(t)  # Q4_K: whole groups of its int4 plane move
    g = t.group_size
    if not isinstance(t.planes[0], Int4Codes):  # Q6_K, Q5_K: scales and d are not one group
        return t.dequantize()[:, index]
    groups = index.view(-1, g) if len(index) % g == 0 else None
    whole = groups is not None and bool((groups[:, 0] % g == 0).all())
    if not whole or not torch.equal(groups - groups[:, :1], torch.arange(g).expand_as(groups)):
        return exact.dequantize()[:, index]
    group_index = groups[:, 0] // g
    planes = [Int4Codes(p.codes[:, index], p.scale[:, group_index], p.zero[:, group_index], g)
              for p in t.planes]  # fmt: skip
    return QuantizedTensor(t.kind, planes)


def _as_dense(t: Tensor) -> torch.Tensor:
    return t.dequantize() if isinstance(t, QuantizedTensor) else t
