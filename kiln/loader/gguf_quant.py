"""GGUF's block formats read into 4-bit codes with a scale and zero per 32 columns (the form
`kiln.layers.packed` packs), exactly: no value is requantized.

Q4_0 (d, 32 codes): w = d (q - 8).             scale d, zero 0
Q4_1 (d, m, 32 codes): w = d q + m.            scale d, zero m + 8d
Q4_K (256 columns: d, dmin, 8 six-bit scales and mins, codes): w = d sc q - dmin mn, per 32
columns                                        scale d sc, zero 8 d sc - dmin mn
Q8_0 (d, 32 int8): q = 16 hi + lo, two planes: high (hi + 8, scale 16d), low (lo, scale d,
zero 8d)
Q6_K (256 columns: 128 bytes of low 4 bits, 64 of top 2 bits, 16 int8 scales, d): w = d sc (q - 32)
per 16 columns, read into its own form (kiln/layers/q6k_layout.py), 6 bits a code
Q5_K (256 columns: d, dmin, 8 six-bit scales and mins, top bits, low 4 bits): w = d sc q - dmin
mn per 32, read into its own form (kiln/layers/kquant_layout.py), 5 bits a code; Q4_K may be
read into that form too (4 bits a code), for the kernel that reads both

Within a block of 32 (Q4_0/Q4_1) the low nibbles of the 16 bytes are columns 0-15 and the high
nibbles 16-31; in Q4_K each 32 bytes hold two 32-column sub-blocks, low nibbles first. Other
types (Q5_0, Q5_1, Q2_K, Q3_K) have no kernel here: the loader dequantizes them."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from kiln.layers.kquant_layout import KQuantCodes
from kiln.layers.packed import Int4Codes, QuantizedTensor, as_int4_plane
from kiln.layers.q6k_layout import Q6KCodes

PACKED_GGUF_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K", "Q5_K")
GROUP = 32


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 fields ([..., 2] bytes) as float32 [..., 1]."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., B] bytes -> [..., 2B] codes: low nibbles, then high nibbles."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _plane(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> Int4Codes:
    n = codes.shape[0]
    return Int4Codes(
        torch.from_numpy(np.ascontiguousarray(codes.reshape(n, -1), dtype=np.uint8)),
        torch.from_numpy(np.ascontiguousarray(scale.reshape(n, -1), dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(zero.reshape(n, -1), dtype=np.float32)),
        GROUP,
    )


def q4_0(blocks: np.ndarray) -> list[Int4Codes]:
    d = _f16(blocks[..., 0:2])
    return [_plane(_nibbles(blocks[..., 2:18]), d, np.zeros_like(d))]


def q4_1(blocks: np.ndarray) -> list[Int4Codes]:
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    return [_plane(_nibbles(blocks[..., 4:20]), d, m + 8 * d)]


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins ([..., 8] each)."""
    s = s.astype(np.uint8)
    low_sc, low_mn = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    high_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return (
        np.concatenate([low_sc, high_sc], -1).astype(np.float32),
        np.concatenate([low_mn, high_mn], -1).astype(np.float32),
    )


def q4_k_codes(blocks: np.ndarray) -> list[KQuantCodes]:
    """Q4_K for kiln's K-quant kernel: its codes, six-bit scales and mins, d and dmin as they
    are (`q4_k`'s int4 plane folds them into a scale and zero per 32 columns)."""
    n, b = blocks.shape[:2]
    qs = _view(blocks)[..., 16:144].reshape(n, b, 4, 1, 32)
    return [_k_codes(blocks, torch.cat([qs & 15, qs >> 4], 3).reshape(n, -1), 4)]


def q4_k(blocks: np.ndarray) -> list[Int4Codes]:
    """Q4_K as the int4 plane the int4 kernels take (`as_int4_plane` of its codes)."""
    return as_int4_plane(QuantizedTensor("Q4_K", q4_k_codes(blocks))).planes  # type: ignore[return-value]


def q8_0(blocks: np.ndarray) -> list[Int4Codes]:
    d = _f16(blocks[..., 0:2])
    q = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8)
    high = (q >> 4).astype(np.int16) + 8  # arithmetic shift: -8..7
    low = (q & 15).astype(np.int16)
    return [_plane(high, 16 * d, np.zeros_like(d)), _plane(low, d, 8 * d)]


def _view(blocks: np.ndarray) -> torch.Tensor:
    """A tensor over the file's bytes, never written: PyTorch warns of a read-only array (the
    file is mapped read-only), which copying 200+ MB a tensor would only silence."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(blocks)


def q6_k(blocks: np.ndarray) -> list[Q6KCodes]:
    """Each 128 columns of a block take 64 bytes of low 4 bits (columns 0-31 in the low nibbles
    of bytes 0-31, 32-63 in those of bytes 32-63, 64-95 and 96-127 in their high nibbles) and 32
    bytes of top 2 bits (columns l, 32 + l, 64 + l, 96 + l in bits 0-1, 2-3, 4-5, 6-7 of byte
    l). In torch's (threaded) ops: a 1B head's 262M codes in 0.7-0.9 s where numpy took 5.2."""
    n, b = blocks.shape[:2]
    raw = _view(blocks)
    ql = raw[..., :128].reshape(n, b, 2, 2, 32)  # [.., half, byte half, l]
    qh = raw[..., 128:192].reshape(n, b, 2, 1, 32)
    codes = torch.empty(n, b, 2, 4, 32, dtype=torch.uint8)  # m = 0..3: columns 32 m + l
    for m in range(4):
        low = ql[:, :, :, m % 2] & 15 if m < 2 else ql[:, :, :, m % 2] >> 4
        codes[:, :, :, m] = low | ((qh[:, :, :, 0] >> (2 * m)) & 3) << 4
    sub_scale = raw[..., 192:208].contiguous().view(torch.int8)
    return [Q6KCodes(
        codes.view(n, -1),
        sub_scale.reshape(n, -1),
        torch.from_numpy(_f16(blocks[..., 208:210]).reshape(n, -1)),
    )]  # fmt: skip


def q5_k(blocks: np.ndarray) -> list[KQuantCodes]:
    """A block: d, dmin, 12 bytes of six-bit scales and mins, 32 bytes of top bits (column 32 s
    + l's in bit s of byte l), 128 of low 4 bits (each 32 bytes two sub-blocks, low nibbles
    first, as Q4_K's)."""
    n, b = blocks.shape[:2]
    raw = _view(blocks)
    qh = raw[..., 16:48].reshape(n, b, 1, 32)
    ql = raw[..., 48:176].reshape(n, b, 4, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], 3).reshape(n, b, 8, 32)  # [.., sub-block s, l]
    top = torch.bitwise_right_shift(qh, torch.arange(8, dtype=torch.uint8)[:, None]) & 1
    return [_k_codes(blocks, (low | top << 4).reshape(n, -1), 5)]


def _k_codes(blocks: np.ndarray, codes: torch.Tensor, bits: int) -> KQuantCodes:
    n = blocks.shape[0]
    sc, mn = _k_scales_mins(blocks[..., 4:16])
    d, dmin = (torch.from_numpy(_f16(blocks[..., a : a + 2]).reshape(n, -1)) for a in (0, 2))
    scale, minimum = (torch.from_numpy(x.reshape(n, -1).astype(np.uint8)) for x in (sc, mn))
    return KQuantCodes(codes, scale, minimum, d, dmin, bits)


_READERS = {"Q4_0": (q4_0, 18, 32), "Q4_1": (q4_1, 20, 32), "Q4_K": (q4_k, 144, 256),
            "Q8_0": (q8_0, 34, 32), "Q6_K": (q6_k, 210, 256), "Q5_K": (q5_k, 176, 256)}  # fmt: skip


def gguf_codes(
    kind: str, data: np.ndarray, shape: tuple[int, int], exact_q4_k: bool = False
) -> QuantizedTensor:
    """A 2-D GGUF tensor of a packed type (`data`: [N, bytes per row]) as 4-bit planes, or the
    codes of a type's own kernel (Q6_K, Q5_K; Q4_K with `exact_q4_k`: the K-quant kernel's,
    which `kiln.layers.packed.for_device` turns into the int4 plane where it does not run)."""
    read, block_bytes, block_cols = _READERS[kind]
    if kind == "Q4_K" and exact_q4_k:
        read = q4_k_codes
    n, k = shape
    blocks = np.asarray(data).reshape(n, k // block_cols, block_bytes)
    return QuantizedTensor(kind, read(blocks))
