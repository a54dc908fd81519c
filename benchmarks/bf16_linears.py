"""kiln's CPU bf16 matmul against oneDNN's bf16 linear, and against the int4 kernel on the same
layers' packed weights, side by side in one process.

Every layer of a model has its own weights (30 layers of the embedded model's shapes by
default: fused qkv, o, fused gate/up, down), so a pass reads them from memory as a decode step
does. Times are ms per pass over all layers, the best of three rounds, each round timing each
kernel in turn; GFLOP/s are the passes' multiply-adds.

    python benchmarks/bf16_linears.py                        # rows 1 to 528
    python benchmarks/bf16_linears.py --rows 1 2 4 8 16 --int4   # and the int4 kernel
    python benchmarks/bf16_linears.py --shape qwen3-0.6b --layers 28"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from kiln.layers.bf16_kernel import bf16_matmul_kernel, pack_pairs
from kiln.layers.linear import prepack_for_cpu

# [out, in] of one layer's linears as kiln fuses them
SHAPES = {
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "qwen3-0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
}


def best_of(rounds: int, runs: dict) -> dict[str, float]:
    """ms per call of each function, the best of `rounds`, the functions alternating."""
    best = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            run()  # warm
            t0 = time.perf_counter()
            run()
            best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
    return best


def int4_layers(shapes, layers: int):
    from kiln.layers.cpu_int4_layout import cpu_block_n, cpu_pack
    from kiln.layers.int4_kernel import int4_matmul_kernel
    from kiln.layers.packed import _kernel_product

    kernel, group = int4_matmul_kernel(), 32
    if kernel is None:
        return None
    planes = []
    for _ in range(layers):
        layer = []
        for n, k in shapes:
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
            sz = torch.stack([torch.rand(k // group, n), torch.randn(k // group, n)], -1)
            layer.append([(cpu_pack(codes, cpu_block_n()), sz.bfloat16().contiguous())])
        planes.append(layer)

    def run(x):
        for layer in planes:
            for (_, k), plane in zip(shapes, layer):
                _kernel_product(kernel, x[k], plane, group).to(torch.bfloat16)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 528])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--int4", action="store_true", help="also the int4 kernel on packed planes")
    args = ap.parse_args()
    kernel = bf16_matmul_kernel()
    if kernel is None:
        raise SystemExit("kiln's bf16 kernel does not run here (it needs AVX512-BF16)")
    shapes, g = SHAPES[args.shape], torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=g).bfloat16() for n, k in shapes]
               for _ in range(args.layers)]  # fmt: skip
    onednn = [[prepack_for_cpu(w) for w in layer] for layer in weights]
    pairs = [[pack_pairs(w) for w in layer] for layer in weights]
    del weights
    int4 = int4_layers(shapes, args.layers) if args.int4 else None
    print(f"{'rows':>5} {'oneDNN ms':>10} {'kiln ms':>9} {'ratio':>6} {'kiln GFLOP/s':>13}"
          + (f" {'int4 ms':>8}" if int4 else ""))  # fmt: skip
    for rows in args.rows:
        x = {k: torch.randn(rows, k, generator=g).bfloat16() for _, k in shapes}
        runs = {"onednn": _run_onednn(onednn, shapes, x)}
        runs["kiln"] = _run_kiln(kernel, pairs, shapes, x)
        if int4:
            runs["int4"] = functools.partial(int4, x)
        ms = best_of(args.rounds, runs)
        flops = 2 * rows * sum(n * k for n, k in shapes) * args.layers
        ratio, rate = ms["onednn"] / ms["kiln"], flops / ms["kiln"] / 1e6
        line = f"{rows:>5} {ms['onednn']:>10.2f} {ms['kiln']:>9.2f} {ratio:>5.2f}x {rate:>13.0f}"
        print(line + (f" {ms['int4']:>8.2f}" if int4 else ""))


def _run_onednn(layers, shapes, x):
    def run():
        for layer in layers:
            for (_, k), w in zip(shapes, layer):
                torch.ops.mkldnn._linear_pointwise(x[k], w, None, "none", [], "")

    return run


def _run_kiln(kernel, layers, shapes, x):
    def run():
        for layer in layers:
            for (n, k), w in zip(shapes, layer):
                kernel.matmul(x[k], w, n)

    return run


if __name__ == "__main__":
    main()
