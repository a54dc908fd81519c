"""Token embedding that can double as a tied LM head."""

import torch
import torch.nn.functional as F
from torch import nn

from kiln.errors import ModelLoadError
from kiln.layers.bf16_kernel import pairs_linear, unpack_pairs
from kiln.layers.linear import onednn_linear, pack_for_cpu, prepack_for_cpu
from kiln.layers.packed import PackedWeight, QuantizedTensor, for_device, unpackable_reason
from kiln.layers.packed_parts import packed_weight


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)
        # the model's dtype, which a packed lookup returns; a tensor, not a torch.dtype
        # attribute, which Dynamo's saved guards cannot hold (it breaks the saved trace)
        self.register_buffer("out_dtype", torch.empty(0), persistent=False)
        self.packed_head: torch.Tensor | None = None
        self.head_layout = "onednn"  # or "pairs" (kiln's bf16 kernel): packed_head's layout
        self.packed: PackedWeight | None = None  # a packed table: lookup and head read it
        self.fallback_reason: str | None = None

    @property
    def layout(self) -> str:
        return "dense" if self.packed is None else self.packed.layout

    def load_weight(self, name: str, weight: torch.Tensor | QuantizedTensor) -> None:
        if tuple(weight.shape) != tuple(self.weight.shape):
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(weight.shape)}, "
                f"expected {tuple(self.weight.shape)}"
            )
        if isinstance(weight, QuantizedTensor):
            self._pack(weight, self.weight.device)  # now: the load never holds all codes
        else:
            self.weight.data.copy_(weight)

    def finalize(self, device: torch.device, used_as_lm_head: bool) -> None:
        """A quantized table stays packed on the CPU, where its rows can be read back for the
        lookup (on CUDA tinygemm's layout cannot, so it is dequantized). Otherwise, on the CPU
        a tied LM head runs fastest from kiln's bf16 kernel's or oneDNN's packed layout (see
        Linear); the lookup table stays as it is, so this costs one more copy of the embedding."""
        if self.packed is not None:
            return
        if device.type == "cpu" and used_as_lm_head and self.packed_head is None:
            self.head_layout, self.packed_head = pack_for_cpu(self.weight)

    def use_onednn(self) -> None:
        """oneDNN's layout for a tied head that `finalize` gave kiln's bf16 kernel."""
        if self.packed_head is not None and self.head_layout == "pairs":
            self.packed_head = prepack_for_cpu(unpack_pairs(self.packed_head, self.weight.shape[0]))
            self.head_layout = "onednn"

    def _pack(self, table: QuantizedTensor, device: torch.device) -> None:
        table = for_device(table, device)
        reason = unpackable_reason(table, device)
        if device.type != "cpu":
            reason = reason or "tinygemm's layout has no row lookup"
        if reason is None:
            self.packed = packed_weight(table, device)
            self.weight = None  # type: ignore[assignment]
        else:
            self.fallback_reason = reason
            self.weight.data.copy_(table.dequantize())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.rows(input_ids, self.out_dtype.dtype)
        return F.embedding(input_ids, self.weight)

    def as_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(hidden)
        if self.packed_head is not None and self.head_layout == "pairs":
            return pairs_linear(hidden, self.packed_head, self.weight.shape[0])
        if self.packed_head is not None:
            return onednn_linear(hidden, self.packed_head)
        return F.linear(hidden, self.weight)
