"""Gated DeltaNet's core (kiln/layers/delta_rule.py): the chunked rule against the token-by-token
one on random inputs, both against HF transformers' PyTorch reference, and the causal
convolution continued across pieces against one pass over the whole sequence."""

from __future__ import annotations

import pytest
import torch

from kiln.layers import delta_rule as dr

H, DK, DV = 3, 8, 6


def _inputs(length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H, length, DK, generator=g)
    k = torch.randn(H, length, DK, generator=g)
    v = torch.randn(H, length, DV, generator=g)
    decay = -torch.rand(H, length, generator=g) * 2  # log decays <= 0
    beta = torch.rand(H, length, generator=g)
    state = torch.randn(H, DK, DV, generator=g)
    return q, k, v, decay, beta, state


def _normalized(q, k):
    return dr.l2_normalize(q) * DK**-0.5, dr.l2_normalize(k)


@pytest.mark.parametrize("length", [1, 5, 16, 17, 64, 130])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_equals_recurrent(length, chunk):
    q, k, v, decay, beta, state = _inputs(length, length)
    q, k = _normalized(q, k)
    out, end = dr.chunked(q, k, v, decay, beta, state, chunk)
    ref_out, ref_end = dr.recurrent(q, k, v, decay, beta, state)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(end, ref_end, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", [1, 7, 100])
def test_both_rules_equal_hf(length):
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, decay, beta, state = _inputs(length, 100 + length)
    as_hf = lambda x: x.transpose(0, 1)[None]  # noqa: E731 - [H, L, ...] -> [1, L, H, ...]
    args = (as_hf(q), as_hf(k), as_hf(v))
    kw = dict(g=as_hf(decay), beta=as_hf(beta), initial_state=state[None],
              output_final_state=True, use_qk_l2norm_in_kernel=True)  # fmt: skip
    ref_chunked = hf.torch_chunk_gated_delta_rule(*args, **kw)
    ref_recurrent = hf.torch_recurrent_gated_delta_rule(*args, **kw)
    qn, kn = _normalized(q, k)
    for ours, ref in ((dr.chunked(qn, kn, v, decay, beta, state), ref_chunked),
                      (dr.recurrent(qn, kn, v, decay, beta, state), ref_recurrent)):  # fmt: skip
        torch.testing.assert_close(as_hf(ours[0]), ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours[1], ref[1][0], rtol=1e-5, atol=1e-5)


def test_the_convolution_continues_across_pieces():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    g = torch.Generator().manual_seed(3)
    channels, width, length = 10, 4, 23
    x, weight = (
        torch.randn(length, channels, generator=g),
        torch.randn(channels, width, generator=g),
    )
    whole = hf.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    state, pieces = torch.zeros(channels, width - 1), []
    for start, end in ((0, 9), (9, 10), (10, 11), (11, 23)):  # a chunk, two decodes, a chunk
        out, state = dr.causal_conv(x[start:end], weight, state)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, x[-(width - 1) :].t())
