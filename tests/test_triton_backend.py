"""The Triton paged-attention backend (the one FULL CUDA graphs capture): the op equals the
pure-PyTorch backend on mixed batches with padding rows, and the engine built on it matches HF
transformers. Without a GPU the kernels run in Triton's CPU interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from kiln.attention.backend import AttentionShape
from kiln.attention.selector import check_triton_runs, select_backend
from kiln.attention.torch_backend import TorchPagedAttentionBackend, torch_paged_attention
from kiln.errors import ConfigError
from kiln.runner.input_buffers import BatchRow, InputBuffers
from tests.helpers import load_benchmark, make_engine
from tests.test_parity import _check, _prompts, _run

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SPLIT_PROGRAMS = 264  # an H200's launch target (two programs per SM), here too: the op splits


def _batch(block_size: int, q_lens: list[int], firsts: list[int], blocks: int):
    """Tokens laid out decodes first, each request's blocks scattered over the cache."""
    width = max(-(-(f + n) // block_size) for f, n in zip(firsts, q_lens))
    g = torch.Generator().manual_seed(3)
    perm = torch.randperm(blocks, generator=g).tolist()
    tables = [perm[i * width : (i + 1) * width] for i in range(len(q_lens))]
    slots, kv_lens, offsets, starts = [], [], [], [0]
    for row, (n, first, table) in enumerate(zip(q_lens, firsts, tables)):
        for p in range(first, first + n):
            slots.append(table[p // block_size] * block_size + p % block_size)
            kv_lens.append(p + 1)
            offsets.append(row * width)
        starts.append(starts[-1] + n)
    flat = torch.tensor([b for t in tables for b in t], dtype=torch.int32)
    return slots, kv_lens, offsets, starts, tables, flat


def _rows(q_lens: list[int], firsts: list[int], tables: list[list[int]]) -> list[BatchRow]:
    return [BatchRow([0] * n, f, table) for n, f, table in zip(q_lens, firsts, tables)]


# two decodes, a fresh prefill and chunked ones: one spans several query blocks of every
# group size below, one sees a cached context of several key tiles
BATCH = ([1, 1, 7, 3, 21], [9, 70, 0, 17, 40])
SHAPES = [  # (block_size, head_dim, query heads, KV heads)
    (4, 16, 4, 2),
    (16, 24, 4, 2),  # a head dim below the dot's 32-wide tile
    (16, 64, 6, 2),  # 3 query heads per KV head: 5 tokens in a 16-row block, one row idle
    (8, 32, 2, 2),  # no grouping
    (16, 16, 32, 2),  # 16 heads per KV head: one token per block
]


def _workspace(h, hkv, head_dim):
    from kiln.attention.triton_backend import segment_workspace

    return segment_workspace(h, hkv, head_dim, SPLIT_PROGRAMS, DEVICE)


def _triton_attention(
    q, k, v, cache, slots, kv_lens, offsets, flat, starts, max_seqs, pad, segments=None,
    workspace=None,
):  # fmt: skip
    from kiln.attention.triton_backend import triton_paged_attention

    t = len(slots)
    workspace = workspace or _workspace(q.shape[1], k.shape[1], q.shape[2])
    query_starts = starts + [t + pad] * (max_seqs + 2 - len(starts))
    ours_cache = cache.to(DEVICE)
    out = torch.full((t + pad, q.shape[1] * q.shape[2]), float("nan"), device=DEVICE)
    out = out.to(q.dtype)
    triton_paged_attention(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), ours_cache[0], ours_cache[1], out,
        torch.tensor(slots + [-1] * pad, device=DEVICE),
        torch.tensor(kv_lens + [0] * pad, dtype=torch.int32, device=DEVICE),
        torch.tensor(offsets + [0] * pad, dtype=torch.int32, device=DEVICE),
        flat.to(DEVICE), torch.tensor(query_starts, dtype=torch.int32, device=DEVICE),
        *workspace, SPLIT_PROGRAMS, q.shape[2] ** -0.5, segments=segments,
    )  # fmt: skip
    assert workspace[1].abs().max() == 0  # every merge reset its ticket
    return out.cpu(), ours_cache.cpu()


@pytest.mark.parametrize(
    ("block_size", "head_dim", "h", "hkv", "dtype"),
    [(*shape, torch.float32) for shape in SHAPES] + [(*SHAPES[2], torch.bfloat16)],
)
def test_op_matches_torch_backend_with_padding(block_size, head_dim, h, hkv, dtype):
    _check_against_torch_backend(block_size, head_dim, h, hkv, dtype, BATCH)


def test_a_bfloat16_cache_under_float32_queries_matches_the_torch_backend():
    """--kv-cache-dtype bfloat16 under a float32 model: the kernel stores the step's keys
    rounded to bf16 (bit for bit what the torch backend writes) and attends every key, the
    chunk's own included, as the cache holds it."""
    _check_against_torch_backend(*SHAPES[2], torch.float32, BATCH, cache_dtype=torch.bfloat16)


# decodes at contexts of 38, 2 and 0 key tiles, a chunk after 5 tiles: segments of uneven
# length (cut every 4 tiles or more), empty ones, and sequences whose keys all sit in segment 0
LONG_BATCH = ([1, 1, 1, 6], [1200, 40, 0, 130])


@pytest.mark.parametrize("segments", [1, 3, 8, None])
def test_split_kv_segments_merge_to_the_unsplit_result(segments):
    """Every split of the keys (the launcher picks one by the token count) gives the same
    output: the segments' softmax states merge exactly, and each merge resets its ticket."""
    _check_against_torch_backend(16, 32, 4, 2, torch.float32, LONG_BATCH, segments, blocks=320)


@pytest.mark.parametrize(("context", "merged"), [(100, False), (300, True)])
def test_only_contexts_of_two_segments_merge(context, merged):
    """A b=1 decode splits 16 ways, but segments are cut every MIN_SEGMENT_KEYS keys or more:
    a 100-key context stays in segment 0, which writes the output without touching the scratch;
    a 300-key one merges three segments through it. Both equal the unsplit launch."""
    slots, kv_lens, offsets, starts, _, flat = _batch(16, [1], [context], 32)
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 32, 16, 2, 32, generator=g)
    q, k, v = (torch.randn(1, n, 32, generator=g) for n in (4, 2, 2))
    args = (q, k, v, cache, slots, kv_lens, offsets, flat, starts, 8, 0)
    workspace = _workspace(4, 2, 32)
    workspace[0].fill_(float("nan"))
    split = _triton_attention(*args, workspace=workspace)[0]
    assert (~workspace[0].isnan()).any().item() == merged
    torch.testing.assert_close(split, _triton_attention(*args, segments=1)[0])


def test_small_launches_split_the_keys():
    """What the launcher picks on an H200: a b=1 decode of Qwen3-0.6B's heads (8 programs
    otherwise) runs in 16 segments, a b=8 one in 2, and a 32-token step in 1 (no split, no
    merge); in the CPU interpreter nothing splits (its programs run one at a time)."""
    from kiln.attention.triton_backend import MAX_SEGMENTS, launch_shape, split_programs_for

    def picked(split_programs):
        # max_num_seqs 256: the sequence slots of a graph, then its padding
        tokens = (1, 8, 32)
        return [launch_shape(t, 16, 8, min(t, 256) + 1, split_programs).segments for t in tokens]

    assert picked(SPLIT_PROGRAMS) == [MAX_SEGMENTS, 2, 1]
    assert picked(split_programs_for(torch.device("cpu"))) == [1, 1, 1]


def _check_against_torch_backend(
    block_size, head_dim, h, hkv, dtype, batch, segments=None, blocks=128, cache_dtype=None
):
    q_lens, firsts = batch
    slots, kv_lens, offsets, starts, tables, flat = _batch(block_size, q_lens, firsts, blocks)
    t, pad = len(slots), 3
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, blocks, block_size, hkv, head_dim, generator=g).to(cache_dtype or dtype)
    q, k, v = (torch.randn(t + pad, n, head_dim, generator=g).to(dtype) for n in (h, hkv, hkv))
    k[t:], v[t:] = float("nan"), float("nan")  # padding rows' inputs cannot reach an output
    out, ours_cache = _triton_attention(
        q, k, v, cache, slots, kv_lens, offsets, flat, starts, 8, pad, segments
    )
    cpu = torch.device("cpu")
    layout = InputBuffers(t, len(tables), len(tables[0]), block_size, cpu).fill(
        _rows(q_lens, firsts, tables), sum(1 for n in q_lens if n == 1)
    )
    meta = TorchPagedAttentionBackend().metadata_builder(t, cpu).build(layout)
    theirs = cache.clone()
    ref = torch.empty(t, h * head_dim, dtype=dtype)
    torch_paged_attention(
        q[:t], k[:t], v[:t], theirs[0], theirs[1], ref, meta.slot_mapping, meta.query_start_loc,
        meta.seq_lens, meta.block_tables, meta.decode_slots, meta.decode_bias, head_dim**-0.5,
    )  # fmt: skip
    # bfloat16: both round the output to it, after products in different orders
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:t].float(), ref.float(), rtol=tol, atol=tol)
    assert out[t:].abs().max() == 0  # padding rows: zeros
    torch.testing.assert_close(ours_cache, theirs, rtol=0, atol=0)  # and no KV written


def test_padding_rows_of_the_runners_buffers_form_their_own_sequence():
    """The query-start buffer as the runner fills it (the batch's offsets, then its token count)
    and pads it for a graph (the graph's size past the last request): the padded launch writes
    every row, zeros for padding, and the real rows as the launch without padding does."""
    from kiln.attention.triton_backend import TritonPagedAttentionBackend

    q_lens, firsts = BATCH
    slots, kv_lens, offsets, starts, tables, flat = _batch(16, q_lens, firsts, 32)
    t, size, max_seqs = len(slots), len(slots) + 5, 8
    b = InputBuffers(64, max_seqs, 8, 16, DEVICE)
    layout = b.fill(_rows(q_lens, firsts, tables), num_decodes=2)
    assert layout.query_start_loc.tolist() == starts
    assert b.query_start_loc.tolist() == starts + [t] * (max_seqs + 2 - len(starts))
    padded = b.pad(layout, size)
    assert b.query_start_loc.tolist() == starts + [size] * (max_seqs + 2 - len(starts))
    backend = TritonPagedAttentionBackend(AttentionShape(4, 2, 16), SPLIT_PROGRAMS)
    meta = backend.metadata_builder(64, DEVICE).build(padded)
    # the builder's per-token views, against the batch laid out by hand
    assert meta.slot_mapping.tolist() == slots + [-1] * 5
    assert meta.token_kv_lens.tolist() == kv_lens + [0] * 5
    assert meta.token_table_offsets.tolist() == offsets + [0] * 5
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 32, 16, 2, 16, generator=g).to(DEVICE)
    q, k, v = (torch.randn(size, n, 16, generator=g).to(DEVICE) for n in (4, 2, 2))
    k[t:], v[t:] = float("nan"), float("nan")
    unpadded = _triton_attention(
        q[:t], k[:t], v[:t], cache.clone(), slots, kv_lens, offsets, flat, starts, max_seqs, 0
    )[0]
    out = torch.full((size, 64), float("nan"), device=DEVICE)
    backend.forward(q, k, v, cache[0], cache[1], out, meta, 0.25)
    torch.testing.assert_close(out[:t].cpu(), unpadded, rtol=0, atol=0)
    assert out[t:].abs().max() == 0


def test_attention_benchmark_checks_triton_against_torch():
    """benchmarks/attention_kernels.py's smoke run: every row timed and the two backends'
    outputs equal on its batches (the check it makes before timing on a GPU)."""
    args = ["--tiny", "--iters", "1", "--dtype", "float32", "--split-programs", "264"]
    rows = load_benchmark("attention_kernels").main(args)
    assert [r["case"] for r in rows] == ["decode b=4, ctx 40", "prefill 24"]
    for row in rows:  # both launches split (at an H200's target): timed unsplit too
        assert row["max_abs_diff"] < 1e-4 and row["unsplit_max_abs_diff"] < 1e-4
        assert min(row["triton_us"], row["unsplit_us"], row["torch_us"], row["sdpa_us"]) > 0


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("block_size", [16, 4])
def test_engine_on_triton_matches_hf(tiny_models, hf_models, name, block_size):
    """The hybrids' Gated DeltaNet layers take the Triton core beside this backend."""
    engine = make_engine(
        tiny_models[name],
        block_size=block_size,
        max_num_batched_tokens=24,
        attention_backend="triton",
    )
    assert engine.boot.attention_backend == "triton_paged"
    prompts = _prompts()
    finals, logits = _run(engine, prompts)
    _check(hf_models[name], prompts, finals, logits)
    cached = finals["4"].num_cached_tokens  # prefix hits read through it too
    if engine.model_config.is_hybrid:  # from a state checkpoint the Triton core saved
        assert 0 < cached <= 40 and cached % block_size == 0
    else:
        assert cached >= 40 - block_size


def test_backend_selection_errors():
    cpu, shape = torch.device("cpu"), AttentionShape(4, 2, 16)
    assert select_backend("auto", cpu, 16, shape).name == "cpu"
    assert select_backend("torch", cpu, 16, shape).name == "torch_paged"
    with pytest.raises(ConfigError, match=r"runs on the CPU only.*--attention-backend auto"):
        select_backend("cpu", torch.device("cuda"), 16, shape)
    assert select_backend("triton", DEVICE, 16, shape).graph_support.value == "always"
    with pytest.raises(ConfigError, match="power-of-two --block-size"):
        select_backend("triton", DEVICE, 12, shape)
    with pytest.raises(ConfigError, match="unknown attention backend"):
        select_backend("flash", cpu, 16, shape)
    # compiled on a GPU (the GPU machine's triton 3.6 too), interpreted on the CPU from 3.9 on
    check_triton_runs(torch.device("cuda"), False, "3.6.0")
    check_triton_runs(cpu, True, "3.9.0")
    with pytest.raises(ConfigError, match=r"needs a CUDA device.*--attention-backend cpu"):
        check_triton_runs(cpu, False, "3.9.0")
    with pytest.raises(ConfigError, match=r"from triton 3\.9 on.*this is triton 3\.6\.0"):
        check_triton_runs(cpu, True, "3.6.0")


@pytest.mark.parametrize(("dtype", "segments"), [("fp32", 1), ("bf16", 1), ("bf16", 16)])
def test_kernels_compile_for_cuda(dtype, segments, tmp_path):
    """The interpreter runs the kernels' Python semantics; this compiles them for real, to a
    Hopper cubin with Triton's bundled ptxas (no GPU needed), specialized as the launcher
    specializes them: the key loops with loaded bounds (pipelined: cp.async), the tensor-core
    dots, the masks and split-KV's merge (barrier, acquire-release ticket, L2 loads) must lower
    through TTIR, TTGIR, PTX and ptxas. In a
    child process, because the interpreter (TRITON_INTERPRET=1 here) replaces Triton's code
    generator."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    cmd = [sys.executable, "-m", "tests.triton_cuda_compile", dtype, str(segments)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["paged_attention_kernel", "ok"]
