"""The Gated DeltaNet core in Triton (`kiln::gdn_core_triton`): the convolution and the delta
rule of `kiln::gdn_core` in two launches per layer whatever the batch, for the Triton attention
backend's models (CUDA, and the CPU under TRITON_INTERPRET=1, which is how the tests check it
against the PyTorch core).

It reads the step's metadata from the runner's whole persistent buffers (`StateBuffers`), so the
grid depends on the token count only and no value comes to the host: a FULL CUDA graph captures
it. Request slot r covers rows qsl[r] to qsl[r + 1]; past the batch, the first slot holds the
padding rows of a graph's size and the later ones are empty, and their state slot is -1: zeros
out, no state read or written.

A convolution program takes one request over BLOCK_C channels and walks its tokens, reading the
window's inputs from the chunk or, before it, from the slot's state. A delta-rule program takes
one request, one value head and BLOCK_V of its value columns, and keeps that part of the state
[key dim, BLOCK_V] (float32) in registers across the request's tokens: a decode is one step,
a prefill chunk one per token (the recurrent form; tensor-core chunks are the next step for long
prefills on the GPU). Both save the state where the metadata asks (a prefix-cache checkpoint
after `checkpoint_at` tokens, the per-token rows of a verification) as the PyTorch core does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.layers.gated_deltanet import register_gdn_core


@triton.jit
def _window_input(mixed_ptr, state_ptr, src, start, c, cmask, from_state, stride_m,
                  W1: tl.constexpr):  # fmt: skip
    """The convolution's input at token index `src`: a row of the chunk, or before the chunk's
    `start` a column of the slot's state (zeros for a fresh request: `from_state` false)."""
    # compared per lane: a mask of a vector and a loaded scalar does not interpret
    in_chunk = (c * 0 + src) >= start
    x = tl.load(mixed_ptr + src * stride_m + c, mask=cmask & in_chunk, other=0.0)
    col = W1 + src - start
    s = tl.load(state_ptr + c * W1 + col, mask=cmask & (~in_chunk), other=0.0)
    s = tl.where(from_state, s.to(tl.float32), 0.0)
    return tl.where(in_chunk, x.to(tl.float32), s)


@triton.jit
def _store_window(dst_ptr, mixed_ptr, state_ptr, end, start, c, cmask, from_state, stride_m,
                  W1: tl.constexpr):  # fmt: skip
    """The state after the tokens before `end`: the last W - 1 inputs, into dst [C, W - 1]."""
    for i in tl.static_range(W1):
        value = _window_input(mixed_ptr, state_ptr, end - W1 + i, start, c, cmask, from_state,
                              stride_m, W1)  # fmt: skip
        tl.store(dst_ptr + c * W1 + i, value.to(dst_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def gdn_conv_kernel(
    mixed_ptr, weight_ptr, conv_states_ptr, saved_conv_ptr, conv_out_ptr, qsl_ptr, seq_lens_ptr,
    slots_ptr, at_ptr, entries_ptr, rows_ptr, C, stride_m, W: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Depthwise causal convolution and SiLU of request slot program_id(0), channels block
    program_id(1): conv_out [T, C] float32; the slot's state [C, W - 1] after its tokens."""
    W1: tl.constexpr = W - 1
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    start, end = tl.load(qsl_ptr + r), tl.load(qsl_ptr + r + 1)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    if (start < end) & (slot >= 0):
        n = end - start
        from_state = tl.load(seq_lens_ptr + r) != n  # not the request's first chunk
        state_ptr = conv_states_ptr + slot * C * W1
        at, entry = tl.load(at_ptr + r), tl.load(entries_ptr + r).to(tl.int64)
        rows_at = tl.load(rows_ptr + r).to(tl.int64)
        for step in range(0, n):
            t = start.to(tl.int64) + step
            acc = tl.zeros([BLOCK_C], dtype=tl.float32)
            for i in tl.static_range(W):
                w = tl.load(weight_ptr + c * W + i, mask=cmask, other=0.0).to(tl.float32)
                acc += w * _window_input(mixed_ptr, state_ptr, t - W1 + i, start, c, cmask,
                                         from_state, stride_m, W1)  # fmt: skip
            tl.store(conv_out_ptr + t * C + c, acc * tl.sigmoid(acc), mask=cmask)
            j = step + 1
            if (at > 0) & (j == at):
                _store_window(saved_conv_ptr + entry * C * W1, mixed_ptr, state_ptr, t + 1,
                              start, c, cmask, from_state, stride_m, W1)  # fmt: skip
            if (rows_at >= 0) & (j < n):
                _store_window(conv_states_ptr + (rows_at + j - 1) * C * W1, mixed_ptr,
                              state_ptr, t + 1, start, c, cmask, from_state, stride_m,
                              W1)  # fmt: skip
        _store_window(state_ptr, mixed_ptr, state_ptr, end, start, c, cmask, from_state,
                      stride_m, W1)  # fmt: skip


@triton.jit
def gdn_rule_kernel(
    conv_out_ptr, decay_ptr, beta_ptr, states_ptr, saved_ptr, out_ptr, qsl_ptr, seq_lens_ptr,
    slots_ptr, at_ptr, entries_ptr, rows_ptr, C, HV, KEY_OFFSET, q_scale,
    PER_KEY: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """The gated delta rule of request slot program_id(0), value head program_id(1), value
    columns block program_id(2): out [T, HV, DV], the state [HV, DK, DV] of its slot."""
    r, h = tl.program_id(0), tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask, vmask = kk < DK, vv < DV
    smask = kmask[:, None] & vmask[None, :]
    head_state = h * DK * DV + kk[:, None] * DV + vv[None, :]
    per_slot = HV * DK * DV
    start, end = tl.load(qsl_ptr + r), tl.load(qsl_ptr + r + 1)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    if (start < end) & (slot < 0):  # padding rows
        for step in range(0, end - start):
            t = start.to(tl.int64) + step
            tl.store(out_ptr + (t * HV + h) * DV + vv,
                     tl.zeros([BLOCK_V], dtype=tl.float32), mask=vmask)  # fmt: skip
    if (start < end) & (slot >= 0):
        n = end - start
        fresh = tl.load(seq_lens_ptr + r) == n
        state = tl.load(states_ptr + slot * per_slot + head_state, mask=smask, other=0.0)
        state = tl.where(fresh, 0.0, state)
        at, entry = tl.load(at_ptr + r), tl.load(entries_ptr + r).to(tl.int64)
        rows_at = tl.load(rows_ptr + r).to(tl.int64)
        key_head = (h // PER_KEY) * DK
        for step in range(0, n):
            t = start.to(tl.int64) + step
            row = conv_out_ptr + t * C
            q = tl.load(row + key_head + kk, mask=kmask, other=0.0)
            k = tl.load(row + KEY_OFFSET + key_head + kk, mask=kmask, other=0.0)
            v = tl.load(row + 2 * KEY_OFFSET + h * DV + vv, mask=vmask, other=0.0)
            q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * q_scale
            k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
            g = tl.load(decay_ptr + t * HV + h)
            b = tl.load(beta_ptr + t * HV + h)
            state = state * tl.exp(g)
            u = (v - tl.sum(state * k[:, None], 0)) * b
            state = state + k[:, None] * u[None, :]
            o = tl.sum(state * q[:, None], 0)
            tl.store(out_ptr + (t * HV + h) * DV + vv, o, mask=vmask)
            j = step + 1
            if (at > 0) & (j == at):
                tl.store(saved_ptr + entry * per_slot + head_state, state, mask=smask)
            if (rows_at >= 0) & (j < n):
                tl.store(states_ptr + (rows_at + j - 1) * per_slot + head_state, state,
                         mask=smask)  # fmt: skip
        tl.store(states_ptr + slot * per_slot + head_state, state, mask=smask)


def request_slots(num_tokens: int, query_start_loc: torch.Tensor) -> int:
    """Programs along the requests: at most one request per token, then the padding slot."""
    return min(num_tokens, query_start_loc.numel() - 2) + 1


def gdn_core_triton(
    mixed: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
    conv_states: torch.Tensor, recurrent_states: torch.Tensor, saved_conv: torch.Tensor,
    saved_recurrent: torch.Tensor, out: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, state_slots: torch.Tensor, checkpoint_at: torch.Tensor,
    checkpoint_entries: torch.Tensor, position_states: torch.Tensor, key_heads: int,
    key_dim: int,
) -> None:  # fmt: skip
    """`kiln::gdn_core` from whole buffers (see StateBuffers): mixed [T, C] (q|k|v), decay and
    beta [T, HV] float32, out [T, HV, DV]; every tensor contiguous."""
    tokens, channels = mixed.shape
    if tokens == 0:
        return
    _check_contiguous(mixed, decay, beta, conv_weight, conv_states, recurrent_states, out)
    value_heads, value_dim = out.shape[1], out.shape[2]
    slots = request_slots(tokens, query_start_loc)
    meta = (query_start_loc, seq_lens, state_slots, checkpoint_at, checkpoint_entries,
            position_states)  # fmt: skip
    conv_out = torch.empty(tokens, channels, dtype=torch.float32, device=mixed.device)
    block_c = min(256, triton.next_power_of_2(channels))
    gdn_conv_kernel[(slots, triton.cdiv(channels, block_c))](
        mixed, conv_weight, conv_states, saved_conv, conv_out, *meta, channels, mixed.stride(0),
        W=conv_weight.shape[-1], BLOCK_C=block_c,
    )  # fmt: skip
    block_v = min(32, triton.next_power_of_2(value_dim))
    grid = (slots, value_heads, triton.cdiv(value_dim, block_v))
    gdn_rule_kernel[grid](
        conv_out, decay, beta, recurrent_states, saved_recurrent, out, *meta, channels,
        value_heads, key_heads * key_dim, key_dim**-0.5, PER_KEY=value_heads // key_heads,
        DK=key_dim, DV=value_dim, BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_v,
    )  # fmt: skip


def _check_contiguous(*tensors: torch.Tensor) -> None:
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("the Triton Gated DeltaNet core takes contiguous tensors")


_LIB = torch.library.Library("kiln", "FRAGMENT")
register_gdn_core(_LIB, "gdn_core_triton", gdn_core_triton)
