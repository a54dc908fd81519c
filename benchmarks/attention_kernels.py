"""The attention op alone, per backend, on one batch shape at a time: decode batches, a fresh and
a chunked prefill, and a mixed batch, with Qwen3-0.6B's heads (16 query heads, 8 KV heads of
128) in a paged cache of 16-token blocks. Each backend's time includes writing the step's keys
and values into the cache; the `sdpa` column is PyTorch's fused attention on contiguous keys
(no paging, no cache write): on a GPU the bound a paged kernel is measured against (on the CPU
its grouped-query decode is slower than the paged backend's, which packs the heads of a group
as rows). Before timing, the Triton op's output is checked against the pure-PyTorch backend's
on the same inputs. Where the Triton launcher splits the keys (split-KV, small batches), the
`unsplit` column times the same launch without the split.

    python benchmarks/attention_kernels.py                 # CUDA: triton, torch and sdpa
    python benchmarks/attention_kernels.py --tiny          # CPU smoke run (triton interpreted)"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # before anything imports triton, which reads it then
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kiln.attention.backend import AttentionShape, BatchLayout
from kiln.attention.torch_backend import TorchPagedAttentionBackend
from kiln.runner.input_buffers import BatchRow, InputBuffers

BLOCK_SIZE = 16


@dataclass
class Case:
    name: str
    query_lens: list[int]  # decodes (1) first, as the runner lays batches out
    contexts: list[int]  # keys each request has in the cache before the step


def cases(tiny: bool) -> list[Case]:
    if tiny:
        return [Case("decode b=4, ctx 40", [1] * 4, [40] * 4), Case("prefill 24", [24], [0])]
    return [
        Case("decode b=1, ctx 1024", [1], [1024]),
        Case("decode b=1, ctx 8192", [1], [8192]),  # one program per KV head: split-KV's case
        Case("decode b=32, ctx 1024", [1] * 32, [1024] * 32),
        Case("decode b=128, ctx 1024", [1] * 128, [1024] * 128),
        Case("prefill 512", [512], [0]),
        Case("prefill 512, ctx 1536", [512], [1536]),
        Case("mixed: 32 decodes + prefill 480", [1] * 32 + [480], [1024] * 32 + [0]),
    ]


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    layout: BatchLayout
    context_keys: list[tuple[torch.Tensor, torch.Tensor]]  # per request, contiguous [L, Hkv, D]


def slots_of(table: list[int], positions: range) -> list[int]:
    return [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def build(case: Case, heads: int, kv_heads: int, head_dim: int, dtype, device) -> Batch:
    """The case's batch with each request's blocks scattered over the cache, laid out in the
    runner's input buffers (the layout both backends build their metadata from)."""
    widths = [-(-(c + n) // BLOCK_SIZE) for c, n in zip(case.contexts, case.query_lens)]
    width, num_blocks = max(widths), sum(widths)
    perm = torch.randperm(num_blocks).tolist()
    tables = [perm[sum(widths[:i]) : sum(widths[: i + 1])] for i in range(len(widths))]
    rows = [BatchRow([0] * n, c, tb) for n, c, tb in zip(case.query_lens, case.contexts, tables)]
    starts = [0]
    for n in case.query_lens:
        starts.append(starts[-1] + n)
    t = starts[-1]
    buffers = InputBuffers(t, len(tables), width, BLOCK_SIZE, device)
    layout = buffers.fill(rows, sum(1 for n in case.query_lens if n == 1))
    cache_shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(cache_shape, dtype=dtype, device=device) for _ in range(2))
    q = torch.randn(t, heads, head_dim, dtype=dtype, device=device)
    k, v = (torch.randn(t, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2))
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    context_keys = []
    for i, (n, first, table) in enumerate(zip(case.query_lens, case.contexts, tables)):
        cached = torch.tensor(slots_of(table, range(first)), dtype=torch.long, device=device)
        own = slice(starts[i], starts[i] + n)
        context_keys.append(
            (torch.cat([flat_k[cached], k[own]]), torch.cat([flat_v[cached], v[own]]))
        )
    return Batch(q, k, v, k_cache, v_cache, layout, context_keys)


def sdpa_reference(batch: Batch, case: Case) -> torch.Tensor:
    """Fused attention on contiguous keys: decodes as one batched call (equal contexts), each
    prefill chunk as its own causal call."""
    q, outs, start = batch.q, [], 0
    decodes = [i for i, n in enumerate(case.query_lens) if n == 1]
    if decodes:
        keys = torch.stack([batch.context_keys[i][0] for i in decodes]).transpose(1, 2)
        values = torch.stack([batch.context_keys[i][1] for i in decodes]).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q[: len(decodes), :, None], keys, values, enable_gqa=True
        )
        outs.append(out.reshape(len(decodes), -1))
        start = len(decodes)
    for i in range(len(decodes), len(case.query_lens)):
        n, ctx = case.query_lens[i], case.contexts[i]
        keys, values = (x.transpose(0, 1)[None] for x in batch.context_keys[i])
        mask = None
        if ctx:
            mask = torch.ones(n, ctx + n, dtype=torch.bool, device=q.device).tril(ctx)
        out = F.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1)[None], keys, values,
            attn_mask=mask, is_causal=mask is None, enable_gqa=True,
        )  # fmt: skip
        outs.append(out[0].transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(outs)


def ops(
    batch: Batch, case: Case, with_triton: bool, split_programs: int | None
) -> tuple[dict, torch.Tensor]:
    """Each backend's call on the batch (writing into one output), and that output."""
    torch_backend = TorchPagedAttentionBackend(batch.q.dtype)
    t, device = batch.layout.num_tokens, batch.q.device
    torch_meta = torch_backend.metadata_builder(t, device).build(batch.layout)
    head_dim = batch.q.shape[2]
    out = batch.q.new_empty(batch.q.shape[0], batch.q.shape[1] * head_dim)

    def run(backend, meta):
        args = (batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, out, meta)
        return lambda: backend.forward(*args, head_dim**-0.5)

    found = {"torch": run(torch_backend, torch_meta), "sdpa": lambda: sdpa_reference(batch, case)}
    if with_triton:
        from kiln.attention.triton_backend import TritonPagedAttentionBackend

        q, k = batch.q, batch.k
        shape = AttentionShape(q.shape[1], k.shape[1], head_dim)
        backend = TritonPagedAttentionBackend(shape, split_programs)
        meta = backend.metadata_builder(t, device).build(batch.layout)
        found["triton"] = run(backend, meta)
        if triton_segments(batch, meta) > 1:  # what the split gains: a backend that never splits
            unsplit = TritonPagedAttentionBackend(shape, split_programs=1)
            unsplit_meta = unsplit.metadata_builder(t, device).build(batch.layout)
            found["unsplit"] = run(unsplit, unsplit_meta)
    return found, out


def triton_segments(batch: Batch, meta) -> int:
    """How many segments the Triton launcher splits this batch's keys into."""
    from kiln.attention.triton_backend import launch_shape, seq_slots

    t, h, _ = batch.q.shape
    slots = seq_slots(t, meta.query_start_loc_buffer)
    return launch_shape(t, h, batch.k.shape[1], slots, meta.split_programs).segments


def time_us(fn, iters: int, device: torch.device) -> float:
    """Median microseconds per call, after warm-up calls (compilation, autotuning; as many as
    timed ones, up to 3: a smoke run of 1 is not worth 3 interpreted warm-ups)."""
    for _ in range(min(3, iters)):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def measure(case: Case, args, device: torch.device) -> dict:
    dtype = getattr(torch, args.dtype)
    batch = build(case, 16, 8, 128, dtype, device)
    with_triton = device.type == "cuda" or args.tiny
    fns, out = ops(batch, case, with_triton, args.split_programs)
    row = {"case": case.name, "tokens": batch.q.shape[0]}
    fns["torch"]()
    reference = out.clone()
    for name in ("triton", "unsplit"):
        if name in fns:
            out.fill_(float("nan"))
            fns[name]()
            key = "max_abs_diff" if name == "triton" else "unsplit_max_abs_diff"
            row[key] = (out - reference).abs().max().item()
    for name, fn in fns.items():
        row[f"{name}_us"] = time_us(fn, args.iters, device)
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| case | tokens | triton us | unsplit us | torch us | sdpa us | triton/sdpa "
        "| torch/triton | diff |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        tri, unsplit = r.get("triton_us"), r.get("unsplit_us")
        cells = [
            r["case"], str(r["tokens"]), f"{tri:.1f}" if tri else "-",
            f"{unsplit:.1f}" if unsplit else "-", f"{r['torch_us']:.1f}",
            f"{r['sdpa_us']:.1f}", f"{tri / r['sdpa_us']:.2f}" if tri else "-",
            f"{r['torch_us'] / tri:.2f}" if tri else "-",
            f"{r['max_abs_diff']:.1e}" if "max_abs_diff" in r else "-",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--tiny", action="store_true", help="small shapes, for a CPU smoke run")
    parser.add_argument(
        "--split-programs", type=int, help="the Triton split-KV launch target (default: the "
        "device's, two programs per SM; 1 on the CPU, where nothing splits)",
    )  # fmt: skip
    parser.add_argument("--output", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    rows = []
    for case in cases(args.tiny):
        rows.append(measure(case, args, device))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
