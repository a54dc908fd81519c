"""The CPU attention backends side by side, the op alone (one layer's call, cache write included,
then the step's metadata, built once for all layers, in its own column): the
pure-PyTorch reference `torch` (gathers every key into a fresh copy), `cpu-flash` (reads runs of
the paged cache in place with the flash kernel, merges them by log-sum-exp) and `cpu` (decode
rows and prefill chunks through kiln's C++ kernels). Cases: decode batches at growing contexts,
a 512-token prefill chunk after a long context, and 16 decodes beside a chunk (a mixed step).
Each request's blocks are consecutive (`--layout contiguous`, what the allocator hands a request
on a fresh cache) or a random permutation (`--layout fragmented`, the worst case: every run one
block long).

    python benchmarks/cpu_attention.py                          # SmolLM2's heads, float32
    python benchmarks/cpu_attention.py --shape qwen3-0.6b --dtype bfloat16
    python benchmarks/cpu_attention.py --gather-max-bytes 0      # try another tuning
    python benchmarks/cpu_attention.py --kv-dtype int8           # --kv-cache-dtype int8"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from kiln.attention.backend import AttentionBackend, AttentionShape
from kiln.attention.cpu_backend import CpuPagedAttentionBackend
from kiln.attention.cpu_metadata import CpuAttentionTuning
from kiln.attention.kv_int8 import quantize
from kiln.attention.torch_backend import TorchPagedAttentionBackend
from kiln.boot.host_memory import keep_freed_memory
from kiln.runner.input_buffers import BatchRow, InputBuffers

SHAPES = {"smollm2": (9, 3, 64), "qwen3-0.6b": (16, 8, 128)}  # heads, KV heads, head dim
DECODE_CASES = [(1, 1024), (1, 4096), (1, 16384), (1, 32768), (16, 512), (16, 2048),
                (16, 4096), (64, 512), (4, 16384)]  # fmt: skip
PREFILL_CONTEXTS = [0, 4096, 16384]
MIXED = (16, 512)  # decodes beside a chunk, each decode's context
CHUNK = 512


def _layout(rows_spec, block_size, layout_kind, gen):
    """rows_spec: [(query length, keys cached before)], decodes first."""
    need = [-(-(first + n) // block_size) for n, first in rows_spec]
    total = sum(need) + 1
    order = torch.randperm(total, generator=gen) if layout_kind == "fragmented" else None
    ids = order.tolist() if order is not None else list(range(total))
    rows, tables = [], []
    for (n, first), blocks in zip(rows_spec, need):
        tables.append(ids[:blocks])
        ids = ids[blocks:]
        rows.append(BatchRow([0] * n, first, tables[-1]))
    tokens = sum(n for n, _ in rows_spec)
    buffers = InputBuffers(tokens, len(rows), max(need), block_size, torch.device("cpu"))
    num_decodes = sum(1 for n, _ in rows_spec if n == 1)
    return buffers.fill(rows, num_decodes), total


def _time(backend: AttentionBackend, layout, caches, q, k, v, repeats: int):
    """(ms per layer call, ms to build the step's metadata, which all layers share)."""
    builder = backend.metadata_builder(q.shape[0], torch.device("cpu"))
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype)
    calls, builds = [], []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        meta = builder.build(layout)
        t1 = time.perf_counter()
        backend.forward(q, k, v, caches[0], caches[1], out, meta, q.shape[-1] ** -0.5)
        if i >= 2:
            builds.append(t1 - t0)
            calls.append(time.perf_counter() - t1)
    return statistics.median(calls) * 1e3, statistics.median(builds) * 1e3


def _kv_dtype(args) -> torch.dtype:
    return getattr(torch, args.kv_dtype or args.dtype)


def _case(name, rows_spec, args, backends, gen):
    heads, kv_heads, dim = SHAPES[args.shape]
    dtype = getattr(torch, args.dtype)
    layout, num_blocks = _layout(rows_spec, args.block_size, args.layout, gen)
    caches = torch.randn(2, num_blocks, args.block_size, kv_heads, dim, generator=gen)
    caches = quantize(caches) if args.kv_dtype == "int8" else caches.to(_kv_dtype(args))
    tokens = layout.num_tokens
    q, k, v = (
        torch.randn(tokens, h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads)
    )
    repeats = max(3, min(30, int(2e6 // (num_blocks * args.block_size * len(rows_spec) + 1))))
    ms = {name: _time(b, layout, caches, q, k, v, repeats) for name, b in backends.items()}
    (torch_ms, torch_build), (cpu_ms, cpu_build) = ms["torch"], ms["cpu"]
    flash_ms = ms["cpu-flash"][0]
    print(f"| {name} | {torch_ms:.3f} | {flash_ms:.3f} | {cpu_ms:.3f} | "
          f"{torch_ms / cpu_ms:.2f}x | {flash_ms / cpu_ms:.2f}x | {torch_build:.3f} | "
          f"{cpu_build:.3f} |", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", choices=SHAPES, default="smollm2")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--kv-dtype", choices=("float32", "bfloat16", "int8"), default=None,
                    help="the cache's (default: --dtype)")  # fmt: skip
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layout", choices=("contiguous", "fragmented"), default="contiguous")
    defaults = CpuAttentionTuning()
    ap.add_argument("--gather-max-bytes", type=int, default=defaults.gather_max_bytes)
    ap.add_argument("--gather-budget-bytes", type=int, default=defaults.gather_budget_bytes)
    ap.add_argument("--min-run", type=int, default=defaults.min_run)
    ap.add_argument("--part-tokens", type=int, default=defaults.part_tokens)
    ap.add_argument("--max-parts", type=int, default=defaults.max_parts)
    ap.add_argument(
        "--decode-kernel",
        choices=("auto", "on", "off"),
        default="auto",
        help="the cpu column's C++ decode kernel (on: even where not vectorised)",
    )
    ap.add_argument("--prefill-kernel", choices=("auto", "off"), default="auto",
                    help="the cpu column's C++ prefill kernel")  # fmt: skip
    ap.add_argument("--only", choices=("decode", "prefill"), default=None)
    args = ap.parse_args()
    keep_freed_memory()  # as the engine does on the CPU: no fresh pages for every gather
    dtype, kv_dtype = getattr(torch, args.dtype), _kv_dtype(args)
    tuning = CpuAttentionTuning(args.gather_max_bytes, args.gather_budget_bytes, args.min_run,
                                args.part_tokens, args.max_parts, args.decode_kernel,
                                args.prefill_kernel)  # fmt: skip
    shape = AttentionShape(*SHAPES[args.shape])
    backends = {
        "torch": TorchPagedAttentionBackend(dtype),
        "cpu-flash": CpuPagedAttentionBackend(
            dtype, shape, replace(tuning, decode_kernel="off", prefill_kernel="off"), kv_dtype
        ),
        "cpu": CpuPagedAttentionBackend(dtype, shape, tuning, kv_dtype),
    }
    gen = torch.Generator().manual_seed(0)
    print(f"{args.shape} {args.dtype} over a {kv_dtype} cache, block size {args.block_size}, "
          f"{args.layout} blocks, "
          f"{torch.get_num_threads()} threads, {tuning}")  # fmt: skip
    print("| case | torch ms | cpu-flash ms | cpu ms | cpu vs torch | cpu vs cpu-flash "
          "| torch metadata ms | cpu metadata ms |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")  # fmt: skip
    if args.only != "prefill":
        for rows, ctx in DECODE_CASES:
            _case(f"decode {rows} x {ctx}", [(1, ctx - 1)] * rows, args, backends, gen)
    if args.only != "decode":
        for ctx in PREFILL_CONTEXTS:
            _case(f"prefill {CHUNK} after {ctx}", [(CHUNK, ctx)], args, backends, gen)
        rows, ctx = MIXED
        _case(f"{rows} decodes x {ctx} + prefill {CHUNK}", [(1, ctx - 1)] * rows + [(CHUNK, 0)],
              args, backends, gen)  # fmt: skip


if __name__ == "__main__":
    main()
