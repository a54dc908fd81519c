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

from kiln.attention.backend import AttentionMetadata
from kiln.attention.selector import select_backend
from kiln.attention.torch_backend import TorchPagedAttentionBackend, torch_paged_attention
from kiln.errors import ConfigError
from tests.helpers import make_engine
from tests.test_parity import _check, _prompts, _run

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _batch(block_size: int, q_lens: list[int], firsts: list[int], pad: int):
    """Tokens laid out decodes first, each request's blocks scattered over the cache."""
    width = max(-(-(f + n) // block_size) for f, n in zip(firsts, q_lens))
    g = torch.Generator().manual_seed(3)
    perm = torch.randperm(64, generator=g).tolist()
    tables = [perm[i * width : (i + 1) * width] for i in range(len(q_lens))]
    slots, kv_lens, offsets, starts = [], [], [], [0]
    for row, (n, first, table) in enumerate(zip(q_lens, firsts, tables)):
        for p in range(first, first + n):
            slots.append(table[p // block_size] * block_size + p % block_size)
            kv_lens.append(p + 1)
            offsets.append(row * width)
        starts.append(starts[-1] + n)
    flat = torch.tensor([b for t in tables for b in t], dtype=torch.int32)
    return slots, kv_lens, offsets, starts, tables, flat, pad


@pytest.mark.parametrize(("block_size", "head_dim"), [(4, 16), (16, 24), (16, 64)])
def test_op_matches_torch_backend_with_padding(block_size, head_dim):
    h, hkv = 4, 2
    q_lens, firsts = [1, 1, 7, 3], [9, 30, 0, 17]  # two decodes, a fresh and a chunked prefill
    slots, kv_lens, offsets, starts, tables, flat, pad = _batch(block_size, q_lens, firsts, 3)
    t = len(slots)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 64, block_size, hkv, head_dim, generator=g)
    q, k, v = (torch.randn(t + pad, n, head_dim, generator=g) for n in (h, hkv, hkv))
    theirs = cache.clone()
    from kiln.attention.triton_backend import triton_paged_attention

    ours_cache = cache.to(DEVICE)
    out = torch.full((t + pad, h * head_dim), float("nan"), device=DEVICE)  # all rows written
    triton_paged_attention(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), ours_cache[0], ours_cache[1], out,
        torch.tensor(slots + [-1] * pad, device=DEVICE),
        torch.tensor(kv_lens + [0] * pad, dtype=torch.int32, device=DEVICE),
        torch.tensor(offsets + [0] * pad, dtype=torch.int32, device=DEVICE),
        flat.to(DEVICE), head_dim**-0.5,
    )  # fmt: skip
    out = out.cpu()
    width = flat.numel() // len(tables)
    meta = AttentionMetadata(
        torch.tensor(slots),
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor([f + n for f, n in zip(firsts, q_lens)], dtype=torch.int32),
        flat.view(len(tables), width),
        t,
        2,
        max(f + n for f, n in zip(firsts, q_lens)),
    )
    meta = TorchPagedAttentionBackend().build_metadata(meta, block_size)
    ref = torch.empty(t, h * head_dim)
    torch_paged_attention(
        q[:t], k[:t], v[:t], theirs[0], theirs[1], ref, meta.slot_mapping, meta.query_start_loc,
        meta.seq_lens, meta.block_tables, meta.decode_slots, meta.decode_bias, head_dim**-0.5,
    )  # fmt: skip
    torch.testing.assert_close(out[:t], ref, rtol=1e-5, atol=1e-5)
    assert out[t:].abs().max() == 0  # padding rows: zeros
    torch.testing.assert_close(ours_cache.cpu(), theirs, rtol=0, atol=0)  # and no KV written


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("block_size", [16, 4])
def test_engine_on_triton_matches_hf(tiny_models, hf_models, name, block_size):
    engine = make_engine(
        tiny_models[name],
        block_size=block_size,
        max_num_batched_tokens=24,
        attention_backend="triton",
    )
    assert engine.attn_backend.name == "triton_paged"
    prompts = _prompts()
    finals, logits = _run(engine, prompts)
    _check(hf_models[name], prompts, finals, logits)
    assert finals["4"].num_cached_tokens >= 40 - block_size  # prefix hits read through it too


def test_backend_selection_errors():
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu, 16).name == "torch_paged"
    assert select_backend("triton", cpu, 16).graph_support.value == "always"
    with pytest.raises(ConfigError, match="power-of-two --block-size"):
        select_backend("triton", cpu, 12)
    with pytest.raises(ConfigError, match="unknown attention backend"):
        select_backend("flash", cpu, 16)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kernels_compile_for_cuda(dtype, tmp_path):
    """The interpreter runs the kernels' Python semantics; this compiles them for real, to a
    Hopper cubin with Triton's bundled ptxas (no GPU needed): the data-dependent `while` loop
    and the masks must lower through TTIR, TTGIR, PTX and ptxas. In a child process, because
    the interpreter (TRITON_INTERPRET=1 here) replaces Triton's code generator."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    cmd = [sys.executable, "-m", "tests.triton_cuda_compile", dtype]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [
        "_write_kv_kernel", "ok", "_paged_attention_kernel", "ok"
    ]  # fmt: skip
