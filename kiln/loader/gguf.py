"""GGUF files: metadata -> ModelConfig (read by gguf_file.py), tensors dequantized to the
compute dtype with the `gguf` package or read as 4-bit planes (gguf_quant.py), tokenizer and
chat template from the file's metadata (via transformers).

Mixture-of-experts files (`qwen3moe`) hold each layer's experts as three stacked tensors,
`ffn_{gate,up,down}_exps` [experts, rows, columns]; they are handed to the model one expert at a
time, under the names transformers saves them with (as codes where the type packs: 4-bit
planes, or Q6_K's and the K-quants' own codes, so the model can keep them packed). A layer
without a router (`ffn_gate_inp`) is a dense one.

llama.cpp's converter can fuse projections (`--fuse-qkv`, `--fuse-gate-up-exps`): `attn_qkv`
holds q, k and v one after another along the rows (for `llama`, q and k in the converter's
permuted order, as apart; for a gated attention, q with each head's gate after it, as its
`attn_q`), `ffn_gate_up_exps` each expert's gate then up rows. They are cut back into the
separate tensors (rows of 4-bit planes stay packed). A hybrid's Gated DeltaNet layers keep
their own `attn_qkv`."""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch

import kiln.loader.gguf_hybrid as hybrid
from kiln.errors import ModelLoadError
from kiln.layers.packed import QuantizedTensor
from kiln.loader.gguf_file import GGUFFile, GGUFTensor
from kiln.loader.gguf_quant import PACKED_GGUF_TYPES, gguf_codes
from kiln.loader.source import ModelSource
from kiln.loader.tokenizer import Tokenizer
from kiln.models.config import ModelConfig, MoEConfig

logger = logging.getLogger(__name__)

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    **hybrid.ARCHITECTURES,
}
SUPPORTED_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the router
}
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def hf_tensor_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; stacked experts
    'blk.3.ffn_up_exps.weight' -> 'model.layers.3.mlp.experts.{}.up_proj.weight', a pattern
    for each expert's name. The hybrid architectures' own names: gguf_hybrid.py."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    if m and m.group(2) in _EXPERT_NAMES and m.group(3) == "weight":
        return f"model.layers.{m.group(1)}.mlp.experts.{{}}.{_EXPERT_NAMES[m.group(2)]}.weight"
    base, _, leaf = gguf_name.rpartition(".")
    return f"{_GLOBAL_NAMES[base]}.{leaf}" if base in _GLOBAL_NAMES else None


# fused tensors (llama.cpp's --fuse-qkv, --fuse-gate-up-exps): the tensors they hold, in row
# order
_FUSED_PARTS = {"attn_qkv": ("attn_q", "attn_k", "attn_v"),
                "ffn_gate_up_exps": ("ffn_gate_exps", "ffn_up_exps")}  # fmt: skip
Rows = tuple[int, int]  # first row, row count


def take_rows(x, rows: Rows | None):
    """Rows of a weight ([rows, ...], or [experts, rows, ...] stacked) or of 4-bit planes."""
    if rows is None:
        return x
    first, count = rows
    if isinstance(x, QuantizedTensor):
        cut = lambda p: p[first : first + count].contiguous()  # noqa: E731
        return QuantizedTensor(x.kind, [p.map_rows(cut) for p in x.planes])
    return x[..., first : first + count, :] if x.ndim == 3 else x[first : first + count]


def _expert_planes(
    name: str, kind: str, t: GGUFTensor, parts: list[tuple[str, Rows | None]]
) -> Iterator[tuple[str, QuantizedTensor]]:
    """A stacked expert tensor ([experts, rows, columns]) as each expert's codes (cut into
    `parts` where it is fused), read one expert at a time; Q4_K as the K-quant kernel's exact
    codes, which the experts turn into int4 planes where that kernel does not run."""
    experts, rows, columns = reversed(t.shape)
    data = np.asarray(t.data).reshape(experts, -1)
    for e in range(experts):
        planes = gguf_codes(kind, data[e], (rows, columns), exact_q4_k=True)
        for part, part_rows in parts:
            yield part.format(e), take_rows(planes, part_rows)


def dequantize(t: GGUFTensor | gguf.ReaderTensor) -> np.ndarray:
    """A GGUF tensor as float32, in PyTorch's dimension order (GGUF lists dims reversed)."""
    kind = t.tensor_type.name
    if kind not in SUPPORTED_TENSOR_TYPES:
        raise ModelLoadError(
            f"tensor {t.name!r} has GGUF type {kind}; kiln dequantizes "
            + ", ".join(SUPPORTED_TENSOR_TYPES)
        )
    data = gguf.quants.dequantize(t.data, t.tensor_type)
    return data.reshape([int(d) for d in reversed(t.shape)])


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves q/k rows per head for its rotary layout; undo it so
    the rotate-half RoPE of HF Llama applies."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute_planes(t: QuantizedTensor, n_heads: int) -> QuantizedTensor:
    """unpermute_qk on the rows of every plane: codes, scales and zeros move together."""

    def rows(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(unpermute_qk(x.numpy(), n_heads)))

    return QuantizedTensor(t.kind, [p.map_rows(rows) for p in t.planes])


class GGUFSource(ModelSource):
    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.file = GGUFFile(path)
        except Exception as exc:
            raise ModelLoadError(f"{path!r} is not a readable GGUF file: {exc}") from None
        self.arch = self._field("general.architecture")
        if self.arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"GGUF architecture {self.arch!r} is not supported; kiln reads "
                + ", ".join(GGUF_ARCHITECTURES)
            )
        self.config = self._model_config()

    def _field(self, key: str, default: Any = None) -> Any:
        return self.file.fields.get(key, default)

    def _model_config(self) -> ModelConfig:
        a = self.arch
        heads = self._field(f"{a}.attention.head_count")
        hidden = self._field(f"{a}.embedding_length")
        names = {t.name for t in self.file.tensors}
        vocab = self._field(f"{a}.vocab_size") or len(self._field("tokenizer.ggml.tokens", []))
        eos = self._field("tokenizer.ggml.eos_token_id")
        head_dim = self._field(f"{a}.attention.key_length") or hidden // heads
        fields = dict(
            architecture=GGUF_ARCHITECTURES[a],
            vocab_size=vocab,
            hidden_size=hidden,
            # a file whose layers all have experts may leave the dense size out
            intermediate_size=self._field(f"{a}.feed_forward_length")
            or self._field(f"{a}.expert_feed_forward_length"),
            num_layers=self._field(f"{a}.block_count"),
            num_heads=heads,
            num_kv_heads=self._field(f"{a}.attention.head_count_kv", heads),
            head_dim=head_dim,
            max_position_embeddings=self._field(f"{a}.context_length", 2048),
            rms_norm_eps=self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=self._field(f"{a}.rope.freq_base", 10000.0),
            rope_scaling=self._rope_scaling(),
            tie_word_embeddings="output.weight" not in names,
            attention_bias=bool({"blk.0.attn_q.bias", "blk.0.attn_qkv.bias"} & names),
            qk_norm=any(n.endswith("attn_q_norm.weight") for n in names),
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (eos,),
            **self._moe_config(names),
        )
        if a in hybrid.ARCHITECTURES:
            fields.update(hybrid.hybrid_config(self._arch_field, a, head_dim))
        return ModelConfig(**fields)

    def _arch_field(self, key: str) -> Any:
        return self._field(f"{self.arch}.{key}")

    def _num_layers(self) -> int:
        """The model's own layers (a hybrid file may count MTP blocks after them)."""
        if self.arch in hybrid.ARCHITECTURES:
            return hybrid.text_layers(self._arch_field)
        return self._field(f"{self.arch}.block_count")

    def _moe_config(self, names: set[str]) -> dict[str, Any]:
        """The experts' shape, and which layers have them (those with a router)."""
        a, experts = self.arch, self._field(f"{self.arch}.expert_count") or 0
        if not experts:
            return {}
        moe = MoEConfig(
            num_experts=experts,
            top_k=self._field(f"{a}.expert_used_count"),
            intermediate_size=self._field(f"{a}.expert_feed_forward_length"),
            # llama.cpp renormalises qwen3moe's top-k weights unless the file says otherwise
            norm_topk_prob=bool(self._field(f"{a}.expert_weights_norm", True)),
            shared_intermediate_size=self._field(f"{a}.expert_shared_feed_forward_length") or 0,
        )
        sparse = tuple(i for i in range(self._num_layers())
                       if f"blk.{i}.ffn_gate_inp.weight" in names)  # fmt: skip
        return {"moe": moe, "sparse_layers": sparse}

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self._field(f"{self.arch}.rope.scaling.type")
        if kind in (None, "none"):
            return None
        return {
            "rope_type": kind,
            "factor": self._field(f"{self.arch}.rope.scaling.factor", 1.0),
            "original_max_position_embeddings": self._field(
                f"{self.arch}.rope.scaling.original_context_length"
            ),
        }

    def tensors(
        self, dtype: torch.dtype, keep_packed: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        if self.arch not in hybrid.ARCHITECTURES:
            yield from self._read(dtype, keep_packed)
            return
        rewrite = hybrid.HybridTensors(self.config.linear_attention)  # type: ignore[arg-type]
        for name, t in self._read(dtype, keep_packed, rewrite.dense):
            yield from rewrite.finish(name, t)

    def _read(
        self, dtype: torch.dtype, keep_packed: bool, adjust=lambda name, t: t
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """Each tensor under its HF name; `adjust(name, float32 tensor)` runs on dense ones
        before they take `dtype`."""
        became: Counter[str] = Counter()
        for t in self.file.tensors:
            parts = self._parts(t.name)
            if not parts:
                continue
            kind = t.tensor_type.name
            what = ("fused " if parts[0][1] is not None else "") + (
                "experts " if "{}" in parts[0][0] else "")  # fmt: skip
            if keep_packed and kind in PACKED_GGUF_TYPES and len(t.shape) in (2, 3):
                form = {"Q6_K": "6-bit codes", "Q5_K": "5-bit codes"}.get(kind, "4-bit planes")
                if kind == "Q4_K":
                    form = "4-bit K-quant codes"
                became[f"{kind} {what}read as {form}"] += 1
                if len(t.shape) == 3:
                    yield from _expert_planes(parts[0][0], kind, t, parts)
                    continue
                packed = gguf_codes(kind, t.data, tuple(reversed(t.shape)), exact_q4_k=True)
                for name, rows in parts:
                    heads = self._permuted_heads(name)
                    piece = take_rows(packed, rows)
                    yield name, piece if heads is None else _unpermute_planes(piece, heads)
                continue
            dense = str(dtype).removeprefix("torch.")
            became[f"{kind} {what}as {dense}" if kind in ("F32", "F16", "BF16")
                   else f"{kind} {what}dequantized to {dense}"] += 1  # fmt: skip
            data = dequantize(t)
            for name, rows in parts:
                yield from self._dense(name, take_rows(data, rows), dtype, adjust)
        logger.info("GGUF tensors: %s", ", ".join(f"{n} {what}" for what, n in became.items()))

    def _dense(self, name: str, data: np.ndarray, dtype: torch.dtype, adjust):
        heads = self._permuted_heads(name)
        if heads is not None:
            data = unpermute_qk(data, heads)
        weight = adjust(name, torch.from_numpy(np.array(data, dtype=np.float32))).to(dtype)
        if "{}" in name:  # stacked experts, one at a time
            yield from ((name.format(e), w) for e, w in enumerate(weight))
            return
        yield name, weight

    def _parts(self, gguf_name: str) -> list[tuple[str, Rows | None]]:
        """The HF tensors a GGUF tensor holds and their rows ([] for none, rows None for all):
        a fused one's parts are named as the file would name them apart."""
        m = re.fullmatch(r"blk\.(\d+)\.(attn_qkv|ffn_gate_up_exps)\.(weight|bias)", gguf_name)
        if m is None or not self._fused_here(int(m.group(1)), m.group(2)):
            name = self._hf_name(gguf_name)
            return [] if name is None else [(name, None)]
        layer, fused, leaf = m.groups()
        c = self.config
        if fused == "attn_qkv":  # a gated attention's q rows hold each head's gate after it
            q_rows = c.num_heads * c.head_dim * (2 if c.attention_output_gate else 1)
            sizes = [q_rows] + [c.num_kv_heads * c.head_dim] * 2
        else:  # each expert's gate, up
            sizes = [c.moe.intermediate_size] * 2  # type: ignore[union-attr]
        firsts = np.cumsum([0, *sizes[:-1]]).tolist()
        parts = []
        for part, first, n in zip(_FUSED_PARTS[fused], firsts, sizes, strict=True):
            name = self._hf_name(f"blk.{layer}.{part}.{leaf}")
            if name is None:
                raise ModelLoadError(f"tensor {gguf_name!r}: kiln reads no {part}.{leaf} here")
            parts.append((name, (first, n)))
        return parts

    def _fused_here(self, layer: int, fused: str) -> bool:
        """Whether `fused` in this layer is llama.cpp's fusion: a hybrid's Gated DeltaNet
        layers have an `attn_qkv` of their own (its in_proj_qkv); its attention layers and
        MTP blocks (past the model's layers) may be fused."""
        if fused != "attn_qkv" or self.arch not in hybrid.ARCHITECTURES:
            return True
        types = self.config.layer_types
        return layer >= len(types) or types[layer] == "full_attention"

    def _hf_name(self, gguf_name: str) -> str | None:
        if self.arch in hybrid.ARCHITECTURES:
            return hybrid.tensor_name(gguf_name, self.arch, self._num_layers(), hf_tensor_name)
        return hf_tensor_name(gguf_name)

    def _permuted_heads(self, name: str) -> int | None:
        """The head count of a q/k projection llama.cpp's converter permuted, else None."""
        if self.arch != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight")):
            return None
        return self.config.num_heads if "q_proj" in name else self.config.num_kv_heads

    def load_tokenizer(self) -> Tokenizer:
        return Tokenizer.from_gguf(self.path, self.config.eos_token_ids)
