"""kiln's kernels as a CPU with AVX2 but without AVX512-VNNI and VBMI runs them (desktops before
AVX-512, Skylake and Cascade Lake servers), built here with `-mavx2 -mfma` in place of
`-march=native`: one row through a Llama-3.2-1B layer's matrices and its Q6_K head, from memory,
rounds alternating in one process.

- Q6_K and Q5_K on their kernels' AVX2 paths against the bf16 weight they were dequantized to
  on such CPUs before those paths (oneDNN's bf16 matmul, as kiln's linears run it without
  AVX512-BF16);
- Q4_K on the K-quant kernel's AVX2 path (4.75 bits a weight, rows as two int8 planes) against
  Q4_K as an int4 plane on the int4 kernel's AVX2 float path (5 bits), the engine's choice for
  Q4_K where the K-quant kernel has no vector path;
- Q4_0-like int4 planes (the scales alone) in PyTorch's AVX2 layout (blocks of 32 rows) on the
  int4 kernel's AVX2 build: float32 rows against two and one int8 planes (`--packed-activations
  int16` and `int8`);
- the native build (AVX512-VNNI here, where the CPU has it) beside each, for scale.

On an AVX-512 CPU the AVX2 builds run 256-bit code at that CPU's speed and bandwidth: a proxy
for an AVX2 machine, not a measurement of one.

    python benchmarks/avx2_kernels.py --rounds 6
"""

from __future__ import annotations

import argparse

import torch
from int4_table_ab import _timed, alternating_rounds  # beside this script
from kquant_kernel import nbytes  # beside this script

from kiln.layers.cpu_int4_layout import cpu_block_n, cpu_pack
from kiln.layers.int4_kernel import load_int4_matmul
from kiln.layers.kquant_kernel import kquant_matmul_kernel, load_kquant_matmul, random_codes
from kiln.layers.kquant_layout import pack_kquant
from kiln.layers.linear import onednn_linear, prepack_for_cpu
from kiln.layers.packed import QuantizedTensor, as_int4_plane, pack_plane
from kiln.layers.q6k_kernel import load_q6k_matmul, q6k_matmul_kernel, random_q6k
from kiln.native import AVX2_FLAGS as AVX2
from kiln.native import runs_avx2

CPU = torch.device("cpu")

# (rows, columns, copies): each copied enough that the copies exceed the cache
SHAPES = {"gate_up 16384x2048": (16384, 2048, 2), "down 2048x8192": (2048, 8192, 8),
          "qkv 3072x2048": (3072, 2048, 12), "head 128256x2048": (128256, 2048, 1)}  # fmt: skip


def shape_runs(n: int, k: int, copies: int, calls: int, g: torch.Generator) -> tuple[dict, dict]:
    """Each way through `copies` random [n, k] matrices, `calls` times each; their bytes."""
    kernels = {"avx2": (load_q6k_matmul(AVX2), load_kquant_matmul(AVX2)),
               "native": (q6k_matmul_kernel(), kquant_matmul_kernel())}  # fmt: skip
    int4 = load_int4_matmul(AVX2)
    block = cpu_block_n()
    q6 = [random_q6k(n, k, g) for _ in range(copies)]
    q5 = [pack_kquant(random_codes(n, k, 5, g)) for _ in range(copies)]
    q4_codes = [random_codes(n, k, 4, g) for _ in range(copies)]
    q4 = [pack_kquant(c) for c in q4_codes]
    planes = [pack_plane(as_int4_plane(QuantizedTensor("Q4_K", [c])).planes[0], CPU)
              for c in q4_codes]  # fmt: skip
    q6_dense = [prepack_for_cpu(kernels["avx2"][0].dequantize_t(w, torch.bfloat16).t().contiguous())
                for w in q6]  # fmt: skip
    x = torch.randn(1, k).bfloat16()

    def each(fns: list) -> float:
        return _timed(lambda: [f(x) for _ in range(calls) for f in fns])

    def on(kernel, ws: list):
        return lambda: each([lambda x, w=w: kernel.matmul(x, w, torch.bfloat16, 2) for w in ws])

    runs = {
        "Q6_K as bf16 (oneDNN)": lambda: each(
            [lambda x, w=w: onednn_linear(x, w) for w in q6_dense]
        )
    }
    sizes = {"Q6_K as bf16 (oneDNN)": n * k * 2}
    for build, (q6k, kq) in kernels.items():
        if q6k is None or kq is None:
            continue
        runs |= {
            f"Q6_K {build}": on(q6k, q6),
            f"Q5_K {build}": on(kq, q5),
            f"Q4_K {build}": on(kq, q4),
        }
        sizes |= {f"Q6_K {build}": nbytes(*vars(q6[0]).values()),
                  f"Q5_K {build}": nbytes(*vars(q5[0]).values()),
                  f"Q4_K {build}": nbytes(*vars(q4[0]).values())}  # fmt: skip
    runs["Q4_K as int4, avx2 float rows"] = lambda: each(
        [lambda x, p=p: int4.matmul_as(x, p[0], p[1], 32, block, torch.bfloat16, 0) for p in planes]
    )
    sizes["Q4_K as int4, avx2 float rows"] = nbytes(*planes[0])
    q4_0 = [(cpu_pack(c.codes, 32), torch.rand(k // 32, n, 1, generator=g).to(torch.bfloat16))
            for c in q4_codes]  # fmt: skip
    for name, planes_in in (("float", 0), ("int16", 2), ("int8", 1)):
        runs[f"Q4_0 B32 avx2 {name}"] = lambda planes_in=planes_in: each([
            lambda x, p=p: int4.matmul_as(x, p[0], p[1], 32, 32, torch.bfloat16, planes_in)
            for p in q4_0])  # fmt: skip
        sizes[f"Q4_0 B32 avx2 {name}"] = nbytes(*q4_0[0])
    return runs, sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=10, help="calls of each copy a measurement")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = parser.parse_args()
    if not runs_avx2():
        raise SystemExit("this CPU has no AVX2 with FMA")
    g = torch.Generator().manual_seed(0)
    for name in args.shapes:
        n, k, copies = SHAPES[name]
        runs, sizes = shape_runs(n, k, copies, args.calls, g)
        median = alternating_rounds(runs, args.rounds, lambda *_: None)
        us = {run: s / (args.calls * copies) * 1e6 for run, s in median.items()}
        print(f"{name} (one row, {copies} copies):")
        for run, t in us.items():
            bits = sizes[run] * 8 / (n * k)
            print(f"  {run:30s} {t:9.1f} us  {bits:5.2f} bits  {sizes[run] / t / 1e3:5.1f} GB/s")


if __name__ == "__main__":
    main()
