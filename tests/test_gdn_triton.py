"""The Triton Gated DeltaNet core (kiln/layers/gdn_triton.py, in Triton's CPU interpreter here)
against the PyTorch core on one padded batch with every case the engine lays out: decodes, a
fresh prefill chunk saving a prefix-cache checkpoint midway, a chunk continuing a state, a
verification keeping its state after each token, padding rows, and buffers whose entries past
the batch are stale. The engine-level checks (HF parity, FULL graphs) are in test_hybrid.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from kiln.layers.gated_deltanet import _gdn_core
from kiln.layers.gdn_triton import CHUNK, gdn_core_triton
from tests.helpers import load_benchmark

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled on a GPU
HK, HV, DK, DV, WIDTH = 2, 4, 16, 8, 4
CHANNELS = 2 * HK * DK + HV * DV
MAX_SEQS, ROWS, ENTRIES = 8, 12, 3
# (tokens this step, KV length after it, slot, checkpoint after, into entry, per-token rows)
REQUESTS = [
    (1, 20, 3, -1, -1, -1),  # decodes continuing their state
    (1, 9, 0, -1, -1, -1),
    (7, 7, 5, 4, 1, -1),  # a fresh prompt's first chunk, a checkpoint after 4 of its tokens
    (6, 30, 2, -1, -1, -1),  # a later chunk
    (3, 12, 1, -1, -1, 8),  # verifying 2 drafts: its state after tokens 1 and 2 into rows 8, 9
]
PADDED = 22
# longer requests: the chunked rule's blocks of CHUNK rows are cut from the step's rows, so
# these start and end mid-block, share blocks with their neighbours and span several; the
# checkpoint lies two blocks into its request, on no block edge
LONG = [
    (1, 50, 3, -1, -1, -1),
    (45, 100, 0, -1, -1, -1),  # rows 1-45: continuing its state over blocks 0 and 1
    (70, 70, 5, 40, 2, -1),  # rows 46-115, fresh, its state after 40 tokens (row 85) saved
    (5, 5, 4, 5, 0, -1),  # the shortest that takes blocks, its checkpoint on its last token
    (3, 12, 1, -1, -1, 8),
    (1, 9, 2, -1, -1, -1),
]
assert CHUNK == 32, "LONG's rows are laid out for blocks of 32"


def _step(seed: int, requests=REQUESTS, padded: int = PADDED):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(r[0] for r in requests)
    starts = torch.tensor([0, *torch.tensor([r[0] for r in requests]).cumsum(0).tolist()])
    qsl = torch.full((MAX_SEQS + 2,), padded, dtype=torch.int32)  # as fill() then pad() leave it
    qsl[: len(starts)] = starts
    whole = [torch.randint(0, 99, (MAX_SEQS,), generator=g, dtype=torch.int32) for _ in range(5)]
    for column, buffer in enumerate(whole):  # stale past the batch, except the slots: -1
        buffer[: len(requests)] = torch.tensor([r[column + 1] for r in requests])
    whole[1][len(requests) :] = -1
    mixed = torch.randn(padded, CHANNELS, generator=g)
    mixed[tokens:] = 0
    decay = -torch.rand(padded, HV, generator=g) * 2
    beta = torch.rand(padded, HV, generator=g)
    weight = torch.randn(CHANNELS, 1, WIDTH, generator=g)
    states = [torch.randn(ROWS, CHANNELS, WIDTH - 1, generator=g),
              torch.randn(ROWS, HV, DK, DV, generator=g),
              torch.randn(ENTRIES, CHANNELS, WIDTH - 1, generator=g),
              torch.randn(ENTRIES, HV, DK, DV, generator=g)]  # fmt: skip
    out = torch.full((padded, HV, DV), float("nan"))
    return (mixed, decay, beta, weight, *states, out), qsl, whole


@pytest.mark.parametrize("requests, padded", [(REQUESTS, PADDED), (LONG, 131)],
                         ids=["short", "long"])  # fmt: skip
def test_the_triton_core_equals_the_pytorch_core(requests, padded):
    layer, qsl, whole = _step(0, requests, padded)
    ours = [t.to(DEVICE, copy=True) for t in layer]
    ref = [t.clone() for t in layer]
    gdn_core_triton(*ours, qsl.to(DEVICE), *(w.to(DEVICE) for w in whole), HK, DK)
    b = len(requests)
    _gdn_core(*ref, qsl[: b + 1], *(w[:b] for w in whole), HK, DK)
    names = ["conv states", "recurrent states", "saved conv", "saved recurrent", "out"]
    for name, a, r in zip(names, ours[4:], ref[4:], strict=True):
        torch.testing.assert_close(a.cpu(), r, rtol=2e-5, atol=2e-5, msg=name)
    assert not ours[-1][sum(r[0] for r in requests) :].any()  # padding rows: zeros
    # the tolerance: float32 sums in another order (the PyTorch core's blocks start at each
    # request's first row, the Triton core's at the step's), over states of norm ~10


def test_a_batch_of_padding_only_touches_no_state():
    """What a graph is captured on: request slots all -1, every row padding."""
    layer, qsl, whole = _step(1)
    qsl[:] = PADDED
    qsl[0] = 0
    whole[1][:] = -1
    ours = [t.to(DEVICE, copy=True) for t in layer]
    gdn_core_triton(*ours, qsl.to(DEVICE), *(w.to(DEVICE) for w in whole), HK, DK)
    for before, after in zip(layer[4:8], ours[4:8], strict=True):
        assert torch.equal(before, after.cpu())
    assert not ours[-1].any()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_kernels_compile_for_cuda(dtype, tmp_path):
    """The interpreter runs the kernels' Python semantics; this lowers them for real, to a
    Hopper cubin with Triton's bundled ptxas (no GPU needed), at Qwen3-Next's shapes: the
    token loops with loaded bounds, the branches that save states, the casts to the model's
    dtype. In a child process: the interpreter replaces Triton's code generator here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    cmd = [sys.executable, "-m", "tests.triton_cuda_compile", "gdn", dtype]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = ["gdn_conv_kernel", "gdn_conv_state_kernel", "gdn_rule_kernel",
               "gdn_chunk_prep_kernel", "gdn_chunk_rule_kernel"]  # fmt: skip
    assert done.stdout.split() == [word for kernel in kernels for word in (kernel, "ok")]


def test_the_gdn_benchmark_runs():
    """benchmarks/gdn_op.py's smoke run on the CPU (its Triton rows need a GPU): every row
    timed, for the current op schema."""
    rows = load_benchmark("gdn_op").main(["--small", "--tokens", "1", "8", "--rounds", "1"])
    assert [r["tokens"] for r in rows] == [1, 8]
    assert all(r["kiln"] > 0 and r["hf"] > 0 for r in rows)


def test_a_full_batch_with_padding_reads_no_slot_past_the_buffers():
    """max_seqs requests and padding rows after them: the padding rows' request slot is one
    past the per-request buffers (max_seqs entries). Whatever lies there (here: a view's next
    element, 0, a real state slot) must not be read as a request's slot."""
    requests = [(1, 20 + i, i, -1, -1, -1) for i in range(MAX_SEQS - 1)] + [(9, 9, 7, -1, -1, -1)]
    layer, qsl, whole = _step(2, requests, padded=20)
    backing = [torch.zeros(MAX_SEQS + 1, dtype=torch.int32) for _ in whole]
    for b, w in zip(backing, whole, strict=True):
        b[:MAX_SEQS] = w
    views = [b[:MAX_SEQS] for b in backing]  # element MAX_SEQS: 0 (slot 0, checkpoint 0, ...)
    ours = [t.to(DEVICE, copy=True) for t in layer]
    ref = [t.clone() for t in layer]
    gdn_core_triton(*ours, qsl.to(DEVICE), *(v.to(DEVICE) for v in views), HK, DK)
    _gdn_core(*ref, qsl[: MAX_SEQS + 1], *whole, HK, DK)
    names = ["conv states", "recurrent states", "saved conv", "saved recurrent", "out"]
    for name, a, r in zip(names, ours[4:], ref[4:], strict=True):
        torch.testing.assert_close(a.cpu(), r, rtol=2e-5, atol=2e-5, msg=name)
    assert not ours[-1][sum(r[0] for r in requests) :].any()
