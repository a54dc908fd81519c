"""The CPU decode-attention kernel over caches of different block sizes, each with its blocks in
order (a fresh server) and shuffled (a server whose allocations have interleaved), calls
interleaved in one process so the machine's drift falls on all alike. Median ms per layer over
`--layers` caches taken in turn (the context comes from memory, as in a decode step), and each
against 16-token blocks in order. The choice of `--block-size`'s CPU default rests on it.

    python benchmarks/kv_block_size.py                       # 64 rows x 600 keys, SmolLM2's heads
    python benchmarks/kv_block_size.py --rows 1 --context 7000
    python benchmarks/kv_block_size.py --shape qwen3-0.6b --rows 16 --context 2048 --layers 6

Every case holds its own caches (`--layers` of them): lower `--layers` for larger shapes."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kiln.attention.cpu_kernel import paged_decode_kernel

SHAPES = {"smollm2": (9, 3, 64), "qwen3-0.6b": (16, 8, 128)}  # heads, KV heads, head dim


def layout(rows: int, context: int, block: int, shuffled: bool, layers: int, shape):
    """`layers` bf16 caches of `block`-token blocks and one block table for all of them."""
    _, kv_heads, dim = shape
    per_row = -(-context // block)
    count = rows * per_row
    caches = [
        torch.randn(2, count + 1, block, kv_heads, dim).to(torch.bfloat16) for _ in range(layers)
    ]
    ids = torch.arange(1, count + 1, dtype=torch.int32)
    if shuffled:
        ids = ids[torch.randperm(count)]
    return caches, ids.view(rows, per_row).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--shape", choices=SHAPES, default="smollm2")
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    kernel = paged_decode_kernel()
    if kernel is None:
        raise SystemExit("the CPU decode kernel is not available on this machine")
    heads, _, dim = SHAPES[args.shape]
    cases = [(b, s) for b in args.sizes for s in (False, True)]
    data = {c: layout(args.rows, args.context, *c, args.layers, SHAPES[args.shape]) for c in cases}
    lens = torch.full((args.rows,), args.context, dtype=torch.int32)
    q = torch.randn(args.rows, heads, dim).to(torch.bfloat16)
    out = torch.empty_like(q)
    times: dict[tuple[int, bool], list[float]] = {c: [] for c in cases}
    for _ in range(args.repeats + 2):
        for case in cases:
            caches, table = data[case]
            t0 = time.perf_counter()
            for cache in caches:
                kernel.run(q, cache[0], cache[1], table, lens, out, dim**-0.5)
            times[case].append((time.perf_counter() - t0) / args.layers * 1e3)
    ms = {c: statistics.median(t[2:]) for c, t in times.items()}
    reference = ms.get((16, False))
    print(f"{args.rows} rows x {args.context} keys, {args.shape} heads, bf16 cache")
    print("| block | blocks | ms per layer | against 16 in order |\n| --- | --- | --- | --- |")
    for (block, shuffled), value in ms.items():
        ratio = f"{reference / value:.2f}x" if reference else "-"
        print(f"| {block} | {'shuffled' if shuffled else 'in order'} | {value:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
