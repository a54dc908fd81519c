"""kiln's int4 kernel built from two sources, side by side on a whole model's packed linears:
one decode step's worth of distinct weights (every layer its own, so they come from memory as
in a step), the two kernels' steps interleaved so the machine's drift falls on both alike.
Median ms a step, the weight bytes over that time, and the largest difference of the outputs.

    mkdir -p /tmp/before && git archive HEAD~1 kiln/layers/csrc | tar -x -C /tmp/before
    python benchmarks/int4_kernel_ab.py /tmp/before/kiln/layers/csrc/int4_mm.cpp \\
        kiln/layers/csrc/int4_mm.cpp                         # Llama-3.2-1B's shapes, int16 rows
    python benchmarks/int4_kernel_ab.py A.cpp B.cpp --shape smollm2 --planes 0 1 2 --rows 1 8

`--planes`: how the rows go in (0 float32, 1 or 2 int8 planes: --packed-activations float,
int8, int16). Weights are random codes in groups of 32 with random bf16 scales and zeros."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kiln.layers import int4_kernel
from kiln.layers.cpu_int4_layout import cpu_block_n
from kiln.native import FLAGS

# (out features, in features) of one layer's linears (qkv, o, gate_up, down), the layer count,
# and the tied LM head's vocabulary
SHAPES = {
    "llama-3.2-1b": ([(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 16, 128256),
    "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, 49152),
}
GROUP = 32


def load(source: Path) -> int4_kernel.Int4MatmulKernel:
    """The kernel built from `source` (the headers beside it). A source from before the table's
    width became an argument (kiln before c6a09a2) cannot be called through today's bindings."""
    if "int terms" not in source.read_text():
        raise SystemExit(f"{source}: a kernel without the table-width argument (before c6a09a2)")
    default, int4_kernel.SOURCE = int4_kernel.SOURCE, source
    try:
        return int4_kernel.load_int4_matmul(FLAGS)
    finally:
        int4_kernel.SOURCE = default


def weights(shape: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A step's packed weights: (codes [N, K/2] uint8, scales and zeros [K/G, N, 2] bf16)."""
    layer, layers, vocab = SHAPES[shape]
    hidden = layer[0][1]
    g = torch.Generator().manual_seed(0)
    out = []
    for n, k in layer * layers + [(vocab, hidden)]:
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        scales_zeros = (torch.randn(k // GROUP, n, 2, generator=g) * 0.01).bfloat16()
        out.append((codes, scales_zeros))
    return out


def compare(kernels, step_weights, rows: int, planes: int, repeats: int):
    """(ms a step for each kernel, max |difference| of their outputs)."""
    block = cpu_block_n()
    inputs = {k: torch.randn(rows, k) for k in {sz.shape[0] * GROUP for _, sz in step_weights}}

    def step(kernel):
        return [
            kernel.matmul(inputs[sz.shape[0] * GROUP], codes, sz, GROUP, block, int8_planes=planes)
            for codes, sz in step_weights
        ]

    first, second = (step(k) for k in kernels)
    diff = max((a - b).abs().max().item() for a, b in zip(first, second))
    times: list[list[float]] = [[] for _ in kernels]
    for _ in range(repeats + 1):
        for kernel, spent in zip(kernels, times):
            t0 = time.perf_counter()
            step(kernel)
            spent.append(time.perf_counter() - t0)
    return [statistics.median(t[1:]) * 1e3 for t in times], diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--shape", choices=SHAPES, default="llama-3.2-1b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--planes", type=int, nargs="+", default=[2], choices=(0, 1, 2))
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    kernels = [load(args.before), load(args.after)]
    step_weights = weights(args.shape)
    nbytes = sum(c.numel() + sz.numel() * 2 for c, sz in step_weights)
    print(f"{args.shape}: {len(step_weights)} weights, {nbytes / 1e6:.0f} MB a step")
    print("| rows | planes | before ms (GB/s) | after ms (GB/s) | after / before | max diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in args.rows:
        for planes in args.planes:
            (a, b), diff = compare(kernels, step_weights, rows, planes, args.repeats)
            print(
                f"| {rows} | {planes} | {a:.1f} ({nbytes / a / 1e6:.1f}) | "
                f"{b:.1f} ({nbytes / b / 1e6:.1f}) | {a / b:.2f}x | {diff:.1e} |"
            )


if __name__ == "__main__":
    main()
