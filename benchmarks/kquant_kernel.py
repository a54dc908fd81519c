"""kiln's K-quant kernel (Q5_K and Q4_K at the file's bits) against what those tensors became
before it, one row through a Llama-3.2-1B layer's matrices, from memory, rounds alternating in
one process:

- Q5_K against its bf16 dequantization (run as kiln's bf16 linears run it: kiln's bf16 kernel
  where the CPU has AVX512-BF16, else oneDNN);
- Q4_K on the K-quant kernel (4.75 bits a weight: uint8 scales and mins per 32, float d and
  dmin per 256) against Q4_K as an int4 plane on the int4 kernel (5 bits: a bf16 scale and zero
  per 32), both taking the rows as two int8 planes.

    python benchmarks/kquant_kernel.py --rounds 6
"""

from __future__ import annotations

import argparse

import torch
from int4_table_ab import _timed, alternating_rounds  # beside this script
from q6k_kernel import bf16_call  # beside this script

from kiln.layers.cpu_int4_layout import cpu_block_n
from kiln.layers.int4_kernel import int4_matmul_kernel
from kiln.layers.kquant_kernel import kquant_matmul_kernel, random_codes
from kiln.layers.kquant_layout import pack_kquant
from kiln.layers.packed import QuantizedTensor, as_int4_plane, pack_plane

CPU = torch.device("cpu")

# a 1B layer's matrices, each copied enough that the copies exceed the cache
SHAPES = {"gate_up 16384x2048": (16384, 2048, 2), "down 2048x8192": (2048, 8192, 8),
          "qkv 3072x2048": (3072, 2048, 12)}  # fmt: skip


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def shape_runs(n: int, k: int, copies: int, calls: int, g: torch.Generator) -> dict:
    kq, int4 = kquant_matmul_kernel(), int4_matmul_kernel()
    q5 = [pack_kquant(random_codes(n, k, 5, g)) for _ in range(copies)]
    q4_codes = [random_codes(n, k, 4, g) for _ in range(copies)]
    q4 = [pack_kquant(c) for c in q4_codes]
    planes = [pack_plane(as_int4_plane(QuantizedTensor("Q4_K", [c])).planes[0], CPU)
              for c in q4_codes]  # fmt: skip
    bf16 = [bf16_call(kq.dequantize_t(w, torch.bfloat16).t().contiguous()) for w in q5]
    x = torch.randn(1, k).bfloat16()
    block = cpu_block_n()

    def each(fns: list) -> float:
        return _timed(lambda: [f(x) for _ in range(calls) for f in fns])

    runs = {
        "Q5_K": lambda: each([lambda x, w=w: kq.matmul(x, w, torch.bfloat16, 2) for w in q5]),
        "Q5_K as bf16": lambda: each(bf16),
        "Q4_K": lambda: each([lambda x, w=w: kq.matmul(x, w, torch.bfloat16, 2) for w in q4]),
        "Q4_K as int4": lambda: each([
            lambda x, p=p: int4.matmul_as(x, p[0], p[1], 32, block, torch.bfloat16, 2)
            for p in planes]),
    }  # fmt: skip
    sizes = {"Q5_K": nbytes(*vars(q5[0]).values()), "Q5_K as bf16": n * k * 2,
             "Q4_K": nbytes(*vars(q4[0]).values()), "Q4_K as int4": nbytes(*planes[0])}  # fmt: skip
    return runs, sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=10, help="calls of each copy a measurement")
    args = parser.parse_args()
    if kquant_matmul_kernel() is None or int4_matmul_kernel() is None:
        raise SystemExit("kiln's K-quant kernel needs AVX512-VNNI and AVX512-VBMI")
    g = torch.Generator().manual_seed(0)
    for name, (n, k, copies) in SHAPES.items():
        runs, sizes = shape_runs(n, k, copies, args.calls, g)
        median = alternating_rounds(runs, args.rounds, lambda *_: None)
        us = {run: s / (args.calls * copies) * 1e6 for run, s in median.items()}
        print(f"{name} (one row, {copies} copies):")
        for run, t in us.items():
            bits = sizes[run] * 8 / (n * k)
            base = us["Q5_K as bf16" if run.startswith("Q5") else "Q4_K as int4"]
            print(f"  {run:13s} {t:8.1f} us  {bits:5.2f} bits  {sizes[run] / t / 1e3:5.1f} GB/s"
                  f"  {base / t:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
