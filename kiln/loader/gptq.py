"""HF W4A16 checkpoints (GPTQ, and AutoRound's GPTQ packing) read into 4-bit planes.

A quantized linear `x.proj` is stored as `x.proj.qweight` (int32 [K / (32/bits), N], codes
packed along K, lowest bits first), `x.proj.qzeros` (int32 [K/G, N / (32/bits)], zero points
packed along N), `x.proj.scales` (fp16 [K/G, N]) and, optionally, `x.proj.g_idx` (int32 [K],
the group of each input column) and `x.proj.bias`. The weight is w[n, k] = scale[g, n] *
(q[k, n] - zero[g, n]), g = k // G. GPTQ's original format ("gptq", also AutoRound's
"auto_round:auto_gptq") stores each zero point minus one; "gptq_v2" stores it as it is.

As the int4 kernels' map (code - 8) * scale + zero': scale' = scale, zero' = scale (8 - zero).
8-bit codes become two 4-bit planes (q = 16 hi + lo), as GGUF's Q8_0 does, the zero point
split the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kiln.errors import ModelLoadError
from kiln.layers.packed import Int4Codes, QuantizedTensor

SUPPORTED = (
    'quant_method "gptq" or "auto-round", bits 4 or 8, desc_act false, sym or asym, group '
    'size -1 or a divisor of the input features, packing_format "auto_round:auto_gptq", '
    'checkpoint_format "gptq" or "gptq_v2"'
)
QUANTIZED_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class GPTQFormat:
    method: str
    bits: int
    group_size: int  # -1: one group over all input features
    zero_offset: int  # added to stored zero points: 1 in GPTQ's original format


def gptq_format(config: dict[str, Any]) -> GPTQFormat:
    """The format a `quantization_config` describes, or a ModelLoadError naming what is read."""
    method = config.get("quant_method")
    if method not in ("gptq", "auto-round"):
        raise ModelLoadError(f"quantization {method!r} is not supported; kiln reads {SUPPORTED}")
    bits = config.get("bits")
    problems = []
    if bits not in (4, 8):
        problems.append(f"bits {bits}")
    if config.get("desc_act"):
        problems.append("desc_act true (act-order: columns in another order than groups)")
    packing = config.get("packing_format", "auto_round:auto_gptq")
    if method == "auto-round" and packing != "auto_round:auto_gptq":
        problems.append(f"packing_format {packing!r}")
    checkpoint = config.get("checkpoint_format", "gptq")
    if checkpoint not in ("gptq", "gptq_v2"):
        problems.append(f"checkpoint_format {checkpoint!r}")
    if config.get("data_type", "int") != "int":
        problems.append(f"data_type {config.get('data_type')!r}")
    if problems:
        raise ModelLoadError(
            f"this {method} checkpoint has {', '.join(problems)}; kiln reads {SUPPORTED}"
        )
    zero_offset = 1 if checkpoint == "gptq" else 0
    return GPTQFormat(method, bits, int(config.get("group_size", -1)), zero_offset)


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32/bits codes each (lowest bits first), unpacked along `dim`."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    words = packed.to(torch.int32).unsqueeze(dim + 1)
    view = [1] * words.dim()
    view[dim + 1] = per_word
    codes = (words >> shifts.view(view)) & ((1 << bits) - 1)
    shape = list(packed.shape)
    shape[dim] *= per_word
    return codes.reshape(shape)


def gptq_tensor(name: str, parts: dict[str, torch.Tensor], fmt: GPTQFormat) -> QuantizedTensor:
    """One linear's qweight/qzeros/scales (and g_idx) as 4-bit planes ([N, K])."""
    missing = [p for p in QUANTIZED_PARTS[:3] if p not in parts]
    if missing:
        raise ModelLoadError(f"quantized layer {name!r} lacks {', '.join(missing)}")
    q = _unpack(parts["qweight"], fmt.bits, 0).t()  # [N, K]
    scales = parts["scales"].float().t()  # [N, K/G]
    zeros = _unpack(parts["qzeros"], fmt.bits, 1).t().float() + fmt.zero_offset
    n, k = q.shape
    groups = scales.shape[1]
    if k % groups or zeros.shape[1] != groups or scales.shape[0] != n:
        raise ModelLoadError(
            f"quantized layer {name!r}: qweight {tuple(parts['qweight'].shape)}, scales "
            f"{tuple(parts['scales'].shape)} and qzeros {tuple(parts['qzeros'].shape)} disagree"
        )
    group = k // groups
    if "g_idx" in parts and not torch.equal(
        parts["g_idx"].long(), torch.arange(k) // group
    ):  # act-order despite the config
        raise ModelLoadError(f"layer {name!r} has an act-order g_idx; kiln reads {SUPPORTED}")
    scales, zeros, group = _kernel_groups(scales, zeros, group)
    if fmt.bits == 4:
        return QuantizedTensor(fmt.method, [_plane(q, scales, scales * (8 - zeros), group)])
    # w = s (16 hi + lo - z), z = 16 zh + zl: planes 16 s (hi - zh) and s (lo - zl), whose
    # zeros stay small multiples of s (exact in bf16 for the symmetric z = 128)
    high, low, zh, zl = q >> 4, q & 15, torch.div(zeros, 16, rounding_mode="floor"), zeros % 16
    return QuantizedTensor(
        fmt.method,
        [
            _plane(high, 16 * scales, 16 * scales * (8 - zh), group),
            _plane(low, scales, scales * (8 - zl), group),
        ],
    )


def _kernel_groups(scales: torch.Tensor, zeros: torch.Tensor, group: int):
    """A group wider than the kernels take (group_size -1: one per row) is also groups of 128,
    64 or 32 columns of the same scale and zero."""
    for size in (128, 64, 32):
        if group > 256 and group % size == 0:
            repeat = group // size
            return scales.repeat_interleave(repeat, 1), zeros.repeat_interleave(repeat, 1), size
    return scales, zeros, group


def _plane(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int):
    return Int4Codes(codes.to(torch.uint8).contiguous(), scale.contiguous(),
                     zero.contiguous(), group)  # fmt: skip
