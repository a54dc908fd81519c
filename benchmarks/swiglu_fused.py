"""A gated MLP's gate/up product with SwiGLU's activation fused into kiln's bf16 kernel
(`kiln::bf16_mm_silu_mul`), against the product followed by silu(gate) * up compiled by Inductor
(the path a bf16 model took before), side by side in one process on the same weights.

Every layer has its own weight (30 of the embedded model's by default), so a pass reads them
from memory as a step does. ms per pass over all layers, the median of `--rounds` rounds, the
two paths alternating; the error columns are each path's largest difference from float64 by
hand on the first layer.

    python benchmarks/swiglu_fused.py                          # rows 1 to 512, SmolLM2's MLP
    python benchmarks/swiglu_fused.py --shape qwen3-0.6b --layers 28"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kiln.layers.bf16_kernel import bf16_matmul_kernel, pack_pairs, unpack_pairs

SHAPES = {"smollm2-135m": (576, 1536), "qwen3-0.6b": (1024, 3072)}  # hidden, intermediate


def silu_mul(y: torch.Tensor, n: int) -> torch.Tensor:
    gate, up = y.split(n, dim=-1)
    return torch.nn.functional.silu(gate) * up


def largest_error(got: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, n: int) -> float:
    full = x.double() @ unpack_pairs(packed, 2 * n).double().t()
    return (got.double() - silu_mul(full, n)).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    kernel = bf16_matmul_kernel()
    if kernel is None:
        raise SystemExit("kiln's bf16 kernel does not run here (it needs AVX512-BF16)")
    hidden, n = SHAPES[args.shape]
    g = torch.Generator().manual_seed(0)
    weights = [pack_pairs((torch.randn(2 * n, hidden, generator=g) * 0.05).bfloat16())
               for _ in range(args.layers)]  # fmt: skip
    compiled = torch.compile(silu_mul, dynamic=True)
    print(
        "| rows | product + Inductor's silu * up, ms | fused, ms | speed-up | error before | "
        "error fused |\n| --- | --- | --- | --- | --- | --- |"
    )
    for rows in args.rows:
        x = torch.randn(rows, hidden, generator=g).bfloat16()
        paths = {
            "separate": lambda w, x=x: compiled(kernel.matmul(x, w, 2 * n), n),
            "fused": lambda w, x=x: kernel.silu_mul(x, w, n),
        }
        errors = {name: largest_error(run(weights[0]), x, weights[0], n)
                  for name, run in paths.items()}  # fmt: skip
        spent: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.rounds + 1):
            for name, run in paths.items():
                t0 = time.perf_counter()
                for w in weights:
                    run(w)
                spent[name].append((time.perf_counter() - t0) * 1e3)
        a, b = (statistics.median(spent[name][1:]) for name in paths)
        print(
            f"| {rows} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {errors['separate']:.1e} | "
            f"{errors['fused']:.1e} |"
        )


if __name__ == "__main__":
    main()
