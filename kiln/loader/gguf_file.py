"""A GGUF file's metadata and tensor index, read in one pass over its header.

gguf-py's `GGUFReader` makes two numpy memmap views for every string of the metadata, and the
embedded model's vocabulary and merges are 98,000 strings: its constructor took 2.6 s, half of
an eager boot and of `kiln info --plan-only`. This reads the same header with `struct` in
~0.1 s. The tensors stay memory-mapped, with gguf-py's layout (its dequantizers take them as
they are) and its type tables; `tests/test_gguf.py` checks every field and tensor against
`GGUFReader`."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

GGUF_MAGIC = 0x46554747  # b"GGUF" read as a little-endian uint32
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
V = gguf.GGUFValueType
T = gguf.GGMLQuantizationType
_SCALARS = {
    V.UINT8: "B",
    V.INT8: "b",
    V.UINT16: "H",
    V.INT16: "h",
    V.UINT32: "I",
    V.INT32: "i",
    V.FLOAT32: "f",
    V.UINT64: "Q",
    V.INT64: "q",
    V.FLOAT64: "d",
    V.BOOL: "?",
}
# tensors stored as plain numbers; every other type is blocks of bytes (gguf-py's layout)
_PLAIN_TENSORS = {
    T.F16: np.float16,
    T.F32: np.float32,
    T.F64: np.float64,
    T.I8: np.int8,
    T.I16: np.int16,
    T.I32: np.int32,
    T.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file kiln can read (the loader reports it with the path)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order, fastest-varying dimension first
    data: np.ndarray  # memory-mapped: numbers, or [..., bytes per row] for block types


class GGUFFile:
    def __init__(self, path: str) -> None:
        self._data = np.memmap(path, mode="r")
        self._bytes = memoryview(self._data)  # slices without numpy's per-view cost
        self._pos = 0
        magic = self._unpack("<I")
        if magic != GGUF_MAGIC:
            raise GGUFFormatError("no GGUF magic number at the start")
        version = self._unpack("<I")
        # a file written on a big-endian machine reads as a version with its low bytes zero
        self._order = ">" if version & 0xFFFF == 0 else "<"
        if self._order == ">":
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in SUPPORTED_VERSIONS:
            raise GGUFFormatError(f"GGUF version {version} (kiln reads versions 2 and 3)")
        tensor_count, field_count = self._unpack("Q"), self._unpack("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = self._string()
            self.fields[key] = self._value(V(self._unpack("I")))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        names = [info[0] for info in infos]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise GGUFFormatError(f"tensors {twice} appear more than once")
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment {alignment!r} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _unpack(self, fmt: str) -> Any:
        fmt = fmt if fmt[0] in "<>" else self._order + fmt
        (value,) = struct.unpack_from(fmt, self._bytes, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("Q")
        raw = self._bytes[self._pos : self._pos + n]
        self._pos += n
        return str(raw, "utf-8")

    def _value(self, kind: gguf.GGUFValueType) -> Any:
        if kind is V.STRING:
            return self._string()
        if kind is V.ARRAY:
            item, count = V(self._unpack("I")), self._unpack("Q")
            if item in _SCALARS:  # numbers in one read
                fmt = self._order + _SCALARS[item]
                values = np.frombuffer(self._data, np.dtype(fmt), count, self._pos)
                self._pos += values.nbytes
                return values.tolist()
            return [self._value(item) for _ in range(count)]
        return self._unpack(_SCALARS[kind])

    def _tensor_info(self) -> tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]:
        name = self._string()
        dims = tuple(self._unpack("Q") for _ in range(self._unpack("I")))
        return name, dims, T(self._unpack("I")), self._unpack("Q")

    def _tensor(
        self, start: int, name: str, dims: tuple[int, ...], kind: gguf.GGMLQuantizationType, at: int
    ) -> GGUFTensor:
        shape = tuple(reversed(dims))
        if kind in _PLAIN_TENSORS:
            dtype = np.dtype(_PLAIN_TENSORS[kind]).newbyteorder(self._order)
            count = int(np.prod(dims))
        else:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            dtype, count = np.dtype(np.uint8), int(np.prod(dims)) * size // block
            shape = gguf.quants.quant_shape_to_byte_shape(shape, kind)
        end = start + at + count * dtype.itemsize
        if end > len(self._data):
            raise GGUFFormatError(f"tensor {name!r} runs past the end of the file")
        data = np.frombuffer(self._data, dtype, count, start + at).reshape(shape)
        return GGUFTensor(name, kind, dims, data)
