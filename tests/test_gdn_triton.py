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
from kiln.layers.gdn_triton import gdn_core_triton

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


def _step(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(r[0] for r in REQUESTS)
    starts = torch.tensor([0, *torch.tensor([r[0] for r in REQUESTS]).cumsum(0).tolist()])
    qsl = torch.full((MAX_SEQS + 2,), PADDED, dtype=torch.int32)  # as fill() then pad() leave it
    qsl[: len(starts)] = starts
    whole = [torch.randint(0, 99, (MAX_SEQS,), generator=g, dtype=torch.int32) for _ in range(5)]
    for column, buffer in enumerate(whole):  # stale past the batch, except the slots: -1
        buffer[: len(REQUESTS)] = torch.tensor([r[column + 1] for r in REQUESTS])
    whole[1][len(REQUESTS) :] = -1
    mixed = torch.randn(PADDED, CHANNELS, generator=g)
    mixed[tokens:] = 0
    decay = -torch.rand(PADDED, HV, generator=g) * 2
    beta = torch.rand(PADDED, HV, generator=g)
    weight = torch.randn(CHANNELS, 1, WIDTH, generator=g)
    states = [torch.randn(ROWS, CHANNELS, WIDTH - 1, generator=g),
              torch.randn(ROWS, HV, DK, DV, generator=g),
              torch.randn(ENTRIES, CHANNELS, WIDTH - 1, generator=g),
              torch.randn(ENTRIES, HV, DK, DV, generator=g)]  # fmt: skip
    out = torch.full((PADDED, HV, DV), float("nan"))
    return (mixed, decay, beta, weight, *states, out), qsl, whole


def test_the_triton_core_equals_the_pytorch_core():
    layer, qsl, whole = _step(0)
    ours = [t.to(DEVICE, copy=True) for t in layer]
    ref = [t.clone() for t in layer]
    gdn_core_triton(*ours, qsl.to(DEVICE), *(w.to(DEVICE) for w in whole), HK, DK)
    b = len(REQUESTS)
    _gdn_core(*ref, qsl[: b + 1], *(w[:b] for w in whole), HK, DK)
    names = ["conv states", "recurrent states", "saved conv", "saved recurrent", "out"]
    for name, a, r in zip(names, ours[4:], ref[4:], strict=True):
        torch.testing.assert_close(a.cpu(), r, rtol=2e-5, atol=2e-5, msg=name)
    assert not ours[-1][sum(r[0] for r in REQUESTS) :].any()  # padding rows: zeros
    # the tolerance: float32 sums in another order (the PyTorch core's chunked form for the
    # chunks longer than 4 tokens), over states of norm ~10


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
    assert done.stdout.split() == ["gdn_conv_kernel", "ok", "gdn_rule_kernel", "ok"]
