"""What a call of one of kiln's ops costs from compiled code: through the dispatcher (what
Inductor's generated code did) against its Python implementation called directly (what it does
now, kiln/compiler/direct_calls.py), and the C kernel alone, on one row at the embedded model's
shapes. Calls interleaved in rounds so that the machine's drift falls on all alike; medians, µs.

    python benchmarks/op_call_cost.py
    python benchmarks/op_call_cost.py --threads 1 --rounds 9 --context 1000"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kiln.attention.backend import AttentionShape
from kiln.attention.cpu_backend import CpuPagedAttentionBackend, cpu_paged_attention
from kiln.attention.cpu_kernel import paged_decode_kernel
from kiln.layers.cpu_int4_layout import cpu_pack
from kiln.layers.int4_kernel import CAST_DTYPES, int4_matmul_kernel
from kiln.layers.packed import _int4_or_dense_mm
from kiln.runner.input_buffers import BatchRow, InputBuffers

BLOCK = 16


def _per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def linear_calls(n: int, k: int, planes: int) -> dict[str, Callable[[], object]]:
    """One bf16 row times an [n, k] int4 weight in groups of 32, three ways."""
    g = torch.Generator().manual_seed(0)
    packed = cpu_pack(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g), 64)
    scales_zeros = torch.rand(k // 32, n, 2, generator=g).to(torch.bfloat16)
    dense = torch.empty(0, dtype=torch.bfloat16)  # no dense copy: the kernel at every row count
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    out = torch.empty(1, n, dtype=torch.bfloat16)
    args = (x, packed, scales_zeros, None, None, dense, 32, planes)
    kernel = int4_matmul_kernel()
    op = torch.ops.kiln.int4_or_dense_mm.default
    calls = {
        "dispatcher": lambda: op(*args),
        "direct": lambda: _int4_or_dense_mm(*args),
    }
    if kernel is not None:
        lib, bf16 = kernel.library, CAST_DTYPES[torch.bfloat16]
        ptrs = (x.data_ptr(), packed.data_ptr(), scales_zeros.data_ptr(), out.data_ptr())
        # the tensors stay referenced: the pointers alone would outlive them
        calls["C kernel"] = lambda held=(x, packed, scales_zeros, out): lib.kiln_int4_mm_cast(
            bf16, ptrs[0], 1, k, ptrs[1], ptrs[2], scales_zeros.shape[2], n, 64, 32, bf16, ptrs[3],
            torch.get_num_threads(), planes,
        )  # fmt: skip
    return calls


def attention_calls(context: int) -> dict[str, Callable[[], object]]:
    """One decode row of SmolLM2's attention (9 heads, 3 KV heads of 64) over `context` keys of
    a bf16 cache, cache write included."""
    heads, kv_heads, dim = 9, 3, 64
    blocks = -(-(context + 1) // BLOCK)
    g = torch.Generator().manual_seed(0)
    caches = torch.randn(2, blocks, BLOCK, kv_heads, dim, generator=g).to(torch.bfloat16)
    q, k, v = (torch.randn(1, h, dim, generator=g).to(torch.bfloat16)
               for h in (heads, kv_heads, kv_heads))  # fmt: skip
    layout = InputBuffers(1, 1, blocks, BLOCK, torch.device("cpu")).fill(
        [BatchRow([0], context, list(range(blocks)))], 1
    )
    backend = CpuPagedAttentionBackend(torch.bfloat16, AttentionShape(heads, kv_heads, dim))
    meta = backend.metadata_builder(1, torch.device("cpu")).build(layout)
    out = torch.empty(1, heads * dim, dtype=torch.bfloat16)
    args = (q, k, v, caches[0], caches[1], out, meta.slot_mapping, meta.query_start_loc,
            meta.gathered_rows, meta.decode_slots, meta.decode_bias, meta.pieces,
            meta.piece_slots, meta.kernel_tables, meta.kernel_lens, meta.prefill_tables,
            meta.prefill_starts, meta.prefill_lens, dim**-0.5)  # fmt: skip
    op = torch.ops.kiln.cpu_paged_attention.default
    calls = {"dispatcher": lambda: op(*args), "direct": lambda: cpu_paged_attention(*args)}
    kernel = paged_decode_kernel()
    if kernel is not None:
        calls["C kernel"] = lambda: kernel.step(q, k, v, meta.slot_mapping, caches[0], caches[1],
                                                meta.kernel_tables, meta.kernel_lens, out,
                                                dim**-0.5)  # fmt: skip
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000, help="calls per way and round")
    ap.add_argument("--context", type=int, default=1000, help="keys the attention row reads")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = {
        "int4 linear 64x64 (overhead only)": linear_calls(64, 64, 2),
        "int4 linear 960x576 (qkv), int16 rows": linear_calls(960, 576, 2),
        f"attention, 1 row, {args.context} keys": attention_calls(args.context),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; µs a call, medians of "
          f"{args.rounds} rounds of {args.calls}")  # fmt: skip
    for name, calls in cases.items():
        times: dict[str, list[float]] = {way: [] for way in calls}
        for fn in calls.values():
            _per_call(fn, args.calls // 10)  # warm
        for _ in range(args.rounds):
            for way, fn in calls.items():
                times[way].append(_per_call(fn, args.calls))
        medians = {way: statistics.median(t) for way, t in times.items()}
        shown = "  ".join(f"{way} {t:7.1f}" for way, t in medians.items())
        saved = medians["dispatcher"] - medians["direct"]
        print(f"{name:40s} {shown}   dispatcher - direct {saved:5.1f}")


if __name__ == "__main__":
    main()
