"""A model's shape, normalized from an HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kiln.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
)
# Gated DeltaNet models; Qwen3.5 projects q/k/v, z, b and a separately, Qwen3-Next in two
# matrices grouped by key head
HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
# image-text checkpoints whose text model kiln serves: the language model's config is their
# `text_config`, its weights `model.language_model.*` (hf.py), the vision tower is not loaded
VISION_LANGUAGE_ARCHITECTURES = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    norm_topk_prob: bool = True
    shared_intermediate_size: int = 0  # 0: no shared expert

    @property
    def params_per_hidden(self) -> int:
        """A sparse layer's MLP parameters per hidden unit: the router, the experts, the shared
        expert and its gate."""
        shared = self.shared_intermediate_size
        return self.num_experts * (1 + 3 * self.intermediate_size) + 3 * shared + (shared > 0)


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers' shape (Qwen3-Next's `linear_*` fields)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    grouped_projections: bool = True  # Qwen3-Next's in_proj_qkvz / in_proj_ba; else Qwen3.5's

    @property
    def conv_dim(self) -> int:  # q, k and v go through the convolution together
        return 2 * self.num_key_heads * self.key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    def state_bytes(self, conv_dtype: torch.dtype) -> int:
        """One sequence's state in one layer: the convolution's last inputs (model dtype) and
        the delta rule's state (float32)."""
        conv = self.conv_dim * (self.conv_kernel - 1) * conv_dtype.itemsize
        recurrent = self.num_value_heads * self.key_head_dim * self.value_head_dim * 4
        return conv + recurrent


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    moe: MoEConfig | None = None
    sparse_layers: tuple[int, ...] = ()  # the layers whose MLP is `moe`
    # hybrid models: "full_attention" or "linear_attention" per layer (none: all attention)
    layer_types: tuple[str, ...] = ()
    linear_attention: LinearAttentionConfig | None = None
    partial_rotary_factor: float = 1.0
    attention_output_gate: bool = False  # q_proj twice as wide: a sigmoid gate per head dim

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; "
                f"kiln supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.hidden_act != "silu":
            raise ModelLoadError(
                f"hidden_act {self.hidden_act!r} is not supported; expected 'silu'"
            )

        if self.sparse_layers and self.moe is None:
            raise ModelLoadError("sparse_layers needs an MoE config")
        unknown = set(self.layer_types) - {"full_attention", "linear_attention"}
        if unknown:
            raise ModelLoadError(
                f"layer_types {sorted(unknown)} are not supported; kiln runs full_attention "
                "and linear_attention (Gated DeltaNet) layers"
            )
        if "linear_attention" in self.layer_types and self.linear_attention is None:
            raise ModelLoadError("linear_attention layers need the linear_* config fields")

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """The layers with a paged KV cache."""
        if not self.layer_types:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        """The Gated DeltaNet layers, each with a state per sequence."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_layer_ids)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q = self.num_heads * (2 if self.attention_output_gate else 1)
        attention = h * d * (q + self.num_heads + 2 * self.num_kv_heads) + 2 * d * self.qk_norm
        if self.attention_bias:
            attention += d * (q + 2 * self.num_kv_heads)
        mixers = len(self.attention_layer_ids) * attention
        if self.linear_attention is not None:
            la = self.linear_attention
            gdn = h * (la.conv_dim + la.value_dim + 2 * la.num_value_heads) + la.value_dim * h
            gdn += la.conv_dim * la.conv_kernel + la.value_head_dim + 2 * la.num_value_heads
            mixers += len(self.linear_layer_ids) * gdn
        dense = self.num_layers - len(self.sparse_layers)
        mlps = dense * 3 * h * i
        if self.moe is not None:
            mlps += len(self.sparse_layers) * h * self.moe.params_per_hidden
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return mixers + self.num_layers * 2 * h + mlps + embed + h


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """transformers 5 moved rope_theta into rope_parameters; accept both spellings."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params or None
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
    return float(theta), scaling


def hf_architecture(cfg: dict[str, Any]) -> str:
    """The architecture config.json names, or the one its model_type implies ("" if neither)."""
    archs = cfg.get("architectures") or []
    return archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(cfg.get("model_type", ""), "")


def text_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """An image-text checkpoint's config as its text model's own: the `text_config`, with the
    fields HF keeps at the top level (the tie of the output head, the special tokens)."""
    text = dict(cfg.get("text_config") or {})
    if not text:
        raise ModelLoadError(f"config.json of {hf_architecture(cfg)} has no text_config")
    text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", False)  # HF reads the top's
    for key in ("bos_token_id", "eos_token_id"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    text["architectures"] = [VISION_LANGUAGE_ARCHITECTURES[hf_architecture(cfg)]]
    return text


def model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    arch = hf_architecture(cfg)
    if arch in VISION_LANGUAGE_ARCHITECTURES:
        cfg = text_model_config(cfg)
        arch = hf_architecture(cfg)
    if not arch:
        raise ModelLoadError(
            "config.json names no architecture; expected one of "
            + ", ".join((*SUPPORTED_ARCHITECTURES, *VISION_LANGUAGE_ARCHITECTURES))
        )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; kiln supports "
            + ", ".join((*SUPPORTED_ARCHITECTURES, *VISION_LANGUAGE_ARCHITECTURES))
        )
    try:
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        theta, scaling = _rope_from_hf(cfg)
        eos = cfg.get("eos_token_id")
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", *HYBRID_ARCHITECTURES),
            hidden_act=cfg.get("hidden_act", "silu"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            **_moe_from_hf(cfg),
            **_hybrid_from_hf(cfg, arch),
        )
    except KeyError as exc:
        raise ModelLoadError(
            f"config.json lacks the field {exc.args[0]!r} that {arch} needs"
        ) from None


def _moe_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of Qwen-style configs: which layers are sparse (not in `mlp_only_layers`,
    and every `decoder_sparse_step`-th), and the experts' shape."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if not experts:
        return {}
    only_dense = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step") or 1
    layers, qwen3_5 = cfg["num_hidden_layers"], cfg.get("model_type") == "qwen3_5_moe_text"
    sparse = tuple(i for i in range(layers) if i not in only_dense and (i + 1) % step == 0)
    moe = MoEConfig(
        num_experts=experts,
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"],
        # Qwen3.5-MoE's router always renormalises (its config has no such field)
        norm_topk_prob=cfg.get("norm_topk_prob", True) or qwen3_5,
        shared_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
    )
    return {"moe": moe, "sparse_layers": sparse}


def _hybrid_from_hf(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Qwen3-Next's and Qwen3.5's layer pattern, Gated DeltaNet shape and attention details.
    Qwen3.5's mRoPE reduces to RoPE for text: its three position rows are equal then."""
    if arch not in HYBRID_ARCHITECTURES:
        return {}
    params = cfg.get("rope_parameters") or {}
    linear = LinearAttentionConfig(
        num_key_heads=cfg["linear_num_key_heads"],
        num_value_heads=cfg["linear_num_value_heads"],
        key_head_dim=cfg["linear_key_head_dim"],
        value_head_dim=cfg["linear_value_head_dim"],
        conv_kernel=cfg["linear_conv_kernel_dim"],
        grouped_projections=arch == "Qwen3NextForCausalLM",
    )
    return {
        "layer_types": tuple(cfg["layer_types"]),
        "linear_attention": linear,
        "partial_rotary_factor": cfg.get(
            "partial_rotary_factor", params.get("partial_rotary_factor", 1.0)
        ),
        "attention_output_gate": True,
    }


_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}
