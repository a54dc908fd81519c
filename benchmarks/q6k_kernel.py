"""kiln's Q6_K kernel against the bf16 weight that Q6_K was dequantized to before it, one row
through the Q6_K matrices of a Llama-3.2-1B Q4_K_M file (the tied head, a down projection),
from memory, rounds alternating in one process.

The bf16 weight runs as kiln's bf16 linears run it: kiln's bf16 kernel where the CPU has
AVX512-BF16, else oneDNN; oneDNN's time is printed beside it.

    python benchmarks/q6k_kernel.py --rounds 6
    python benchmarks/q6k_kernel.py --rounds 6 --scales-ahead 0 4

`--scales-ahead`: the kernel built with each value of KILN_Q6K_SCALES_AHEAD (sub-scales asked
for that many ahead; 0: not asked for), the builds against each other instead.
"""

from __future__ import annotations

import argparse

import torch
from int4_table_ab import _timed, alternating_rounds  # beside this script

from kiln.layers.bf16_kernel import pairs_linear
from kiln.layers.linear import onednn_linear, pack_for_cpu, prepack_for_cpu
from kiln.layers.q6k_kernel import load_q6k_matmul, q6k_matmul_kernel, random_q6k
from kiln.native import FLAGS

SHAPES = {"head 128256x2048": (128256, 2048), "down 2048x8192 (x8)": (2048, 8192)}


def bf16_call(weight: torch.Tensor):
    """One row times `weight` as a dequantized Linear runs it on this CPU."""
    layout, packed = pack_for_cpu(weight)
    if layout == "pairs":
        return lambda x: pairs_linear(x, packed, weight.shape[0])
    return lambda x: onednn_linear(x, packed)


def shape_runs(kernel, n: int, k: int, calls: int, g: torch.Generator) -> dict:
    """The four ways through `copies` random [n, k] matrices, `calls` times each."""
    copies = 8 if n < 8192 else 1  # eight downs: more than the cache holds
    q6 = [random_q6k(n, k, g) for _ in range(copies)]
    dense = [kernel.dequantize_t(w, torch.bfloat16).t().contiguous() for w in q6]
    bf16 = [bf16_call(w) for w in dense]
    onednn = [prepack_for_cpu(w) for w in dense]
    x = torch.randn(1, k).bfloat16()

    def each(fns: list) -> float:
        return _timed(lambda: [f(x) for _ in range(calls) for f in fns])

    return {
        "Q6_K two planes": lambda: each([lambda x, w=w: kernel.matmul(x, w, torch.bfloat16, 2)
                                         for w in q6]),
        "Q6_K one plane": lambda: each([lambda x, w=w: kernel.matmul(x, w, torch.bfloat16, 1)
                                        for w in q6]),
        "bf16": lambda: each(bf16),
        "bf16 oneDNN": lambda: each([lambda x, w=w: onednn_linear(x, w) for w in onednn]),
    }, copies, sum(t.numel() * t.element_size() for t in vars(q6[0]).values())  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=10, help="calls a measurement (x8 downs)")
    parser.add_argument("--scales-ahead", type=int, nargs="+")
    args = parser.parse_args()
    kernel = q6k_matmul_kernel()
    if kernel is None:
        raise SystemExit("kiln's Q6_K kernel needs AVX512-VNNI and AVX512-VBMI")
    g = torch.Generator().manual_seed(0)
    if args.scales_ahead:
        return builds_against_each_other(args.scales_ahead, args.rounds, args.calls, g)
    for name, (n, k) in SHAPES.items():
        runs, copies, q6_bytes = shape_runs(kernel, n, k, args.calls, g)
        median = alternating_rounds(runs, args.rounds, lambda *_: None)
        ms = {run: s / (args.calls * copies) * 1e3 for run, s in median.items()}
        print(f"{name}: Q6_K {q6_bytes / 2**20:.0f} MiB, bf16 {n * k * 2 / 2**20:.0f} MiB")
        for run, t in ms.items():
            nbytes = q6_bytes if run.startswith("Q6_K") else n * k * 2
            print(f"  {run:16s} {t:7.3f} ms  {nbytes / t / 1e6:5.1f} GB/s  "
                  f"bf16 / this {ms['bf16'] / t:.2f}x")  # fmt: skip


def builds_against_each_other(aheads: list[int], rounds: int, calls: int, g) -> None:
    """Two planes, one row, each shape: the kernel built with each KILN_Q6K_SCALES_AHEAD."""
    builds = {a: load_q6k_matmul((*FLAGS, f"-DKILN_Q6K_SCALES_AHEAD={a}")) for a in aheads}
    for name, (n, k) in SHAPES.items():
        copies = 8 if n < 8192 else 1
        q6 = [random_q6k(n, k, g) for _ in range(copies)]
        x = torch.randn(1, k).bfloat16()

        def run(build, q6=q6, x=x) -> float:
            return _timed(lambda: [build.matmul(x, w, torch.bfloat16, 2)
                                   for _ in range(calls) for w in q6])  # fmt: skip

        runs = {f"ahead {a}": lambda b=b: run(b) for a, b in builds.items()}
        median = alternating_rounds(runs, rounds, lambda *_: None)
        base = median[f"ahead {aheads[0]}"]
        ms = [
            f"{r} {s / (calls * copies) * 1e3:.3f} ms ({base / s:.2f}x)" for r, s in median.items()
        ]
        print(f"{name}: " + ", ".join(ms))


if __name__ == "__main__":
    main()
