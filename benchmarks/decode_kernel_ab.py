"""The CPU decode-attention kernel built from two sources, side by side on the same inputs: a
kernel change measured against the version before it in one process, calls interleaved so the
machine's drift falls on both alike. The op alone (`kernel.run`, no cache write, no metadata),
median of the timed calls per layer, and the largest difference between the two outputs.
`--layers N` gives every call its own layer's cache, N of them in turn, as a decode step reads
them: the context then comes from memory, where one layer's cache alone may sit in the L3.

    mkdir -p /tmp/before && git archive HEAD~1 kiln/attention/csrc | tar -x -C /tmp/before
    python benchmarks/decode_kernel_ab.py /tmp/before/kiln/attention/csrc/paged_decode.cpp \
        kiln/attention/csrc/paged_decode.cpp    # the whole directory: the headers it includes
    python benchmarks/decode_kernel_ab.py A.cpp B.cpp --shapes smollm2 --layers 30
    python benchmarks/decode_kernel_ab.py A.cpp B.cpp --cases 64x600 --hot  # arithmetic alone
    python benchmarks/decode_kernel_ab.py A.cpp B.cpp --layers 30 --runs-of 1  # shuffled blocks
    python benchmarks/decode_kernel_ab.py A.cpp B.cpp --dtypes bf16 --prefill 512x512 4x512

`--prefill TOKENSxCONTEXT` times the prefill kernel (prefill.h, in the same library) instead:
four requests, each a chunk of TOKENS query tokens ending at CONTEXT keys."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kiln import native
from kiln.attention import cpu_kernel, kv_int8

SHAPES = {"smollm2": (9, 3, 64), "qwen3-0.6b": (16, 8, 128)}  # heads, KV heads, head dim
CASES = [(1, 1024), (1, 7000), (1, 16384), (16, 512), (64, 512), (4, 4096)]  # rows, context
DTYPES = {  # (queries, cache)
    "f32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "f32/bf16": (torch.float32, torch.bfloat16),
    "f32/int8": (torch.float32, torch.int8),  # --kv-cache-dtype int8: values and a scale per row
    "bf16/int8": (torch.bfloat16, torch.int8),
}
BLOCK = 16


def load(source: Path) -> cpu_kernel.PagedDecodeKernel:
    return cpu_kernel.load_paged_decode(native.FLAGS, source)


def _cache(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return kv_int8.quantize(values) if dtype == torch.int8 else values.to(dtype)


def _block_ids(count: int, run: int) -> torch.Tensor:
    """Block ids 1..count in runs of `run` consecutive ids, the runs in random order (0: all
    in order, as a fresh server places them)."""
    ids = torch.arange(1, count + 1, dtype=torch.int32)
    if run <= 0:
        return ids
    runs = list(ids.split(run))
    return torch.cat([runs[i] for i in torch.randperm(len(runs)).tolist()])


def compare(kernels, shape, dtypes, rows: int, context: int, repeats: int, layers: int = 1,
            hot: bool = False, run: int = 0):  # fmt: skip
    """(ms per layer of each kernel, max |difference|) on one random batch, each row's blocks
    in order (or in shuffled runs of `run` blocks), over `layers` caches taken in turn; `hot`:
    every row on the same blocks, which then stay in the core's L2 (the kernel's arithmetic
    without the wait for memory)."""
    heads, kv_heads, dim = shape
    per_row = -(-context // BLOCK)
    blocks = (1 if hot else rows) * per_row + 1
    caches = [
        _cache(torch.randn(2, blocks, BLOCK, kv_heads, dim), dtypes[1]) for _ in range(layers)
    ]
    tables = _block_ids(blocks - 1, run).view(-1, per_row).expand(rows, -1)
    tables = tables.contiguous()
    lens = torch.full((rows,), context, dtype=torch.int32)
    q = torch.randn(rows, heads, dim).to(dtypes[0])
    outs = [torch.empty_like(q) for _ in kernels]
    times: list[list[float]] = [[] for _ in kernels]
    for _ in range(repeats + 2):
        for kernel, out, spent in zip(kernels, outs, times):
            t0 = time.perf_counter()
            for cache in caches:
                kernel.run(q, cache[0], cache[1], tables, lens, out, dim**-0.5)
            spent.append((time.perf_counter() - t0) / layers)
    ms = [statistics.median(t[2:]) * 1e3 for t in times]
    return ms, (outs[0].float() - outs[1].float()).abs().max().item()


def compare_prefill(kernels, shape, dtypes, tokens: int, context: int, repeats: int):
    """(ms per call of each kernel, max |difference|) for four requests, each a chunk of
    `tokens` query tokens at the end of its `context` keys, blocks in order."""
    heads, kv_heads, dim = shape
    reqs = 4
    per = -(-context // BLOCK)
    cache = _cache(torch.randn(2, reqs * per + 1, BLOCK, kv_heads, dim), dtypes[1])
    tables = torch.arange(1, reqs * per + 1, dtype=torch.int32).view(reqs, -1).contiguous()
    starts = torch.arange(reqs + 1, dtype=torch.int32) * tokens
    lens = torch.full((reqs,), context, dtype=torch.int32)
    q = torch.randn(reqs * tokens, heads, dim).to(dtypes[0])
    outs = [torch.empty_like(q) for _ in kernels]
    times: list[list[float]] = [[] for _ in kernels]
    for _ in range(repeats + 2):
        for kernel, out, spent in zip(kernels, outs, times):
            t0 = time.perf_counter()
            kernel.prefill(q, cache[0], cache[1], tables, starts, lens, out, dim**-0.5)
            spent.append(time.perf_counter() - t0)
    ms = [statistics.median(t[2:]) * 1e3 for t in times]
    return ms, (outs[0].float() - outs[1].float()).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--layers", type=int, default=1, help="caches read in turn (cold)")
    parser.add_argument("--hot", action="store_true", help="every row on the same blocks (L2)")
    parser.add_argument("--cases", nargs="+", help="ROWSxCONTEXT, e.g. 1x7000 64x512")
    parser.add_argument(
        "--runs-of", type=int, default=0, help="blocks in shuffled runs of N (1: every block)"
    )
    parser.add_argument("--prefill", nargs="+", help="TOKENSxCONTEXT: the prefill kernel")
    args = parser.parse_args()
    kernels = [load(args.before), load(args.after)]
    if args.prefill:
        return prefill_table(kernels, args)
    cases = [tuple(map(int, c.split("x"))) for c in args.cases] if args.cases else CASES
    torch.manual_seed(0)
    print("| shape | q / cache | rows x context | before ms | after ms | speed-up | max diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.shapes:
        for kind in args.dtypes:
            for rows, context in cases:
                (a, b), diff = compare(kernels, SHAPES[name], DTYPES[kind], rows, context,
                                       args.repeats, args.layers, args.hot,
                                       args.runs_of)  # fmt: skip
                print(f"| {name} | {kind} | {rows} x {context} | {a:.3f} | {b:.3f} | "
                      f"{a / b:.2f}x | {diff:.1e} |", flush=True)  # fmt: skip


def prefill_table(kernels, args) -> None:
    print("| shape | q / cache | tokens x context | before ms | after ms | speed-up | max diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    torch.manual_seed(0)
    for name in args.shapes:
        for kind in args.dtypes:
            for tokens, context in (tuple(map(int, c.split("x"))) for c in args.prefill):
                (a, b), diff = compare_prefill(kernels, SHAPES[name], DTYPES[kind], tokens,
                                               context, args.repeats)  # fmt: skip
                print(f"| {name} | {kind} | {tokens} x {context} | {a:.3f} | {b:.3f} | "
                      f"{a / b:.2f}x | {diff:.1e} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
