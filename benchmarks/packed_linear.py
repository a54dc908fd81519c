"""The packed linear's paths against the dense ones, side by side in one process, on the
embedded model's matrix shapes: microseconds per call by row count.

    python benchmarks/packed_linear.py
    python benchmarks/packed_linear.py --rows 1 2 16 64 256 512 --iters 50

Columns: `aten bf16` is PyTorch's CPU int4 kernel on bf16 rows; `aten f32` the same for
float32 rows, split in two bf16 rows (a float32 model's path where kiln's kernel is not built);
`kiln f32` kiln's C++ int4 kernel on float32 rows (kiln/layers/int4_kernel.py: the path below
256 rows where it is built), `kiln x2` the packed layer's op on two planes (Q8_0);
`dequant+mm` the weight dequantized to bf16 and one bf16 matmul (a bf16 model from 256 rows);
`onednn bf16` and `onednn f32` the dense linears of `--quantization none`. Weights are random;
every call reads the same weight, so these are cache-warm kernel times (a whole model's step
streams its weights from memory: benchmarks/decode_step.py). `kiln f32 mem` is kiln's kernel
over distinct weights in turn, 96 MB of them, so each call reads its weight from memory as a
decode step does (one row: 11-28% slower than cache-warm on the AVX-512 dev CPU, 22 GB/s
where the machine reads 32.7, so the kernel is mostly bound by its instructions there).

    python benchmarks/packed_linear.py --rows 1 --from-memory"""

from __future__ import annotations

import argparse
import time

import torch

from kiln.layers.cpu_int4_layout import cpu_block_n, cpu_dequantize_t, pairs_table
from kiln.layers.int4_kernel import int4_matmul_kernel
from kiln.layers.linear import onednn_linear, prepack_for_cpu
from kiln.layers.packed import Int4Codes, PackedInt4, QuantizedTensor, split_float32

# (name, out features, in features) of SmolLM2-135M's linears
SHAPES = [
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
]


def _time(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def _packed(n: int, k: int, planes: int) -> PackedInt4:
    g = torch.Generator().manual_seed(0)
    plane = Int4Codes(
        torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
        torch.rand(n, k // 32, generator=g) * 0.01,
        torch.zeros(n, k // 32),
        32,
    )
    return PackedInt4(QuantizedTensor("bench", [plane] * planes), torch.device("cpu"))


def _from_memory(kernel, n: int, k: int, x32: torch.Tensor, iters: int) -> float:
    """us per call over distinct weights in turn, more of them than the caches hold."""
    copies = min(512, max(2, 96_000_000 // (n * k // 2 + n * k // 32 * 4)))
    planes = [_packed(n, k, 1) for _ in range(copies)]
    calls = [(p.packed0, p.scales_zeros0) for p in planes]
    block = cpu_block_n()

    def one_pass():
        for packed, sz in calls:
            kernel.matmul(x32, packed, sz, 32, block)

    return _time(one_pass, max(1, iters // copies)) / copies


def measure(n: int, k: int, rows: int, iters: int, from_memory: bool = False) -> dict[str, float]:
    one, two = _packed(n, k, 1), _packed(n, k, 2)
    dense = torch.randn(n, k)
    x32 = torch.randn(rows, k)
    x16 = x32.bfloat16()
    p16, p32 = prepack_for_cpu(dense.bfloat16()), prepack_for_cpu(dense)
    sz = pairs_table(one.scales_zeros0)  # aten's kernel takes (scale, zero) pairs
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    its = max(3, iters // max(1, rows // 16)) if n < 10000 else max(3, iters // 10)

    def aten_f32():
        y = mm(split_float32(x32), one.packed0, 32, sz).float()
        return y[:rows] + y[rows:]

    row = {
        "aten bf16": _time(lambda: mm(x16, one.packed0, 32, sz), its),
        "aten f32": _time(aten_f32, its),
    }
    if (kernel := int4_matmul_kernel()) is not None:
        row["kiln f32"] = _time(lambda: kernel.matmul(x32, one.packed0, sz, 32, cpu_block_n()), its)
        if from_memory:
            row["kiln f32 mem"] = _from_memory(kernel, n, k, x32, its)
    row["kiln x2"] = _time(lambda: two(x32), its)
    row["dequant+mm"] = _time(lambda: x16 @ cpu_dequantize_t(one.packed0, sz, 32), its)
    if p16 is not None:
        row["onednn bf16"] = _time(lambda: onednn_linear(x16, p16), its)
    if p32 is not None:
        row["onednn f32"] = _time(lambda: onednn_linear(x32, p32), its)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 16, 256, 512])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--from-memory", action="store_true", help="add `kiln f32 mem`")
    args = parser.parse_args()
    header = None
    for name, n, k in SHAPES:
        for rows in args.rows:
            if name == "lm_head" and rows > 16:
                continue  # the head only sees the rows that sample
            row = measure(n, k, rows, args.iters, args.from_memory)
            if header is None:
                header = list(row)
                print(f"{'shape':>16} {'rows':>5}" + "".join(f"{h:>13}" for h in header))
            print(f"{name:>8} {n:>7} {rows:>5}" + "".join(f"{row[h]:13.1f}" for h in header))


if __name__ == "__main__":
    main()
