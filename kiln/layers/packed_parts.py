"""What a layer's quantized parts become: one packed matrix where they share a format, or
`PackedParts`, each run of parts in one format packed on its own, where they do not.

llama.cpp's Q4_K_M files write attn_v in Q6_K in some layers and attn_q and attn_k in Q4_K, so
a fused qkv has parts of two formats; dequantized whole it streamed a 1B model's qkv in bf16
(12.6 MB a layer) where the file holds 4.4 MB."""

from __future__ import annotations

import torch
from torch import nn

from kiln.layers.kquant_layout import KQuantCodes
from kiln.layers.packed import (
    PackedInt4,
    PackedWeight,
    QuantizedTensor,
    cat_rows,
    for_device,
    quantized_form,
    unpackable_reason,
)
from kiln.layers.packed_kquant import PackedKQuant
from kiln.layers.packed_q6k import PackedQ6K
from kiln.layers.q6k_layout import Q6KCodes


class PackedParts(PackedWeight):
    """Rows of a fused layer in runs of one packed format, each its own packed matrix; their
    outputs concatenated."""

    layout = "parts"

    def __init__(self, runs: list[PackedWeight]) -> None:
        kind = "+".join(dict.fromkeys(r.kind for r in runs))
        super().__init__(kind, sum(r.out_features for r in runs), runs[0].in_features)
        self.parts = nn.ModuleList(runs)

    @property
    def padded_out(self) -> int:
        return self.out_features

    def describe(self) -> str:
        return ", ".join(
            f"{p.out_features} rows {p.kind} {p.describe()}"
            + (" + dense copy" if p.dense is not None else "")
            for p in self.parts
        )

    def products(self) -> list[PackedWeight]:
        return list(self.parts)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts], -1)
        return y if bias is None else y + bias

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize() for part in self.parts])


def packed_weight(t: QuantizedTensor, device: torch.device) -> PackedWeight:
    """The packed module of `t` (unpackable_reason(t, device) is None): Q6_K's own, Q5_K's, or
    int4."""
    if isinstance(t.planes[0], Q6KCodes):
        return PackedQ6K(t)
    return PackedKQuant(t) if isinstance(t.planes[0], KQuantCodes) else PackedInt4(t, device)


def pack_parts(
    parts: list[QuantizedTensor], out_features: int, device: torch.device
) -> tuple[PackedWeight | None, str | None]:
    """(the packed module, None) of a layer's quantized parts in row order, or (None, why they
    stay dense): they do not cover the layer, or a run of them has no kernel on `device`."""
    if sum(p.shape[0] for p in parts) != out_features:
        return None, "its parts mix quantized and dense formats"
    parts = [for_device(p, device) for p in parts]
    runs = [cat_rows(run) for run in _runs_of_one_format(parts)]
    reason = next((r for r in (unpackable_reason(run, device) for run in runs) if r), None)
    if reason is not None:
        return None, reason
    modules = [packed_weight(run, device) for run in runs]
    return (modules[0] if len(modules) == 1 else PackedParts(modules)), None


def _runs_of_one_format(parts: list[QuantizedTensor]) -> list[list[QuantizedTensor]]:
    runs: list[list[QuantizedTensor]] = []
    for part in parts:
        if runs and quantized_form(runs[-1][0]) == quantized_form(part):
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs
