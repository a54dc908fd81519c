"""The Gated DeltaNet core in Triton (`kiln::gdn_core_triton`): the convolution and the delta
rule of `kiln::gdn_core` in five launches per layer whatever the batch, for the Triton attention
backend's models (CUDA, and the CPU under TRITON_INTERPRET=1, which is how the tests check it
against the PyTorch core).

It reads the step's metadata from the runner's whole persistent buffers (`StateBuffers`), so the
grid depends on the token count only and no value comes to the host: a FULL CUDA graph captures
it. Request slot r covers rows qsl[r] to qsl[r + 1]; past the batch, the first slot holds the
padding rows of a graph's size and the later ones are empty, and their state slot is -1: zeros
out, no state read or written.

- The convolution: a program takes BLOCK_T of the step's rows over BLOCK_C channels, all in
  parallel, each row reading its window's inputs from its request's chunk or, before it, from
  the request's slot state (each row finds its request by a binary search over the query
  starts). A second launch, a program per request, then writes the states the step leaves
  (the slot's own last, since the windows read it as it was).
- The delta rule, as the PyTorch core splits it: decodes and verifications (at most
  DECODE_RULE_UP_TO tokens, or state rows kept per token) token by token, the recurrent form;
  longer requests (prefill chunks) in blocks of CHUNK tokens, the chunked form of delta_rule.py,
  whose work is matrix products:
  - the prep (a program per CHUNK rows of the step and value head, all in parallel): each block's
    unit lower-triangular system is solved once, independent of the state, into
    W = (I + A)^-1 (beta exp(gamma) K) and U0 = (I + A)^-1 (beta V), with gamma the decay from
    the start of the request's rows in the block. Blocks are cut from the step's rows, not per
    request, so rows of two requests may share one: A couples rows of the same request only.
  - the chain (a program per value head and BLOCK_V value columns, and per block of the step's
    rows along the requests, each taking the requests at its stride): the state in registers
    across a request's blocks, each block four products: U = U0 - W S, the outputs from S and
    U, S decayed and corrected.
  The recurrent form of a long prefill is one dependent step per token; the chunked form is one
  per CHUNK tokens, the rest parallel.
All save the state where the metadata asks (a prefix-cache checkpoint after `checkpoint_at`
tokens, the per-token rows of a verification) as the PyTorch core does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.layers.gated_deltanet import DECODE_RULE_UP_TO, register_gdn_core

# Tile sizes from ptxas's register report for sm_90 at Qwen3-Next's heads (128 dims; not yet
# timed on a GPU): float32 products at full precision run on the FMA units, whose operands
# stay in registers, so blocks of 64 rows (and the chain's value columns past 16) made ptxas
# spill up to tens of kilobytes a thread; these spill 1.3 KB (the chain) and 0.2 KB (the prep).
CHUNK = 32  # tokens per block of the chunked delta rule
CHUNK_WARPS = 8
CHAIN_VALUES = 16  # value columns per program of the chain
CONV_TOKENS, CONV_CHANNELS = 8, 128  # the convolution's tile: 80 registers (fp32), no spills
# TF32 would round q, k and the state to 10 bits
PRECISION = "ieee"


@triton.jit
def _per_request(ptr, r, REQS, missing):
    """Entry r of a per-request buffer (REQS entries), `missing` past it: the padding rows'
    slot is one past the last request's, so with a full batch it lies past the buffers."""
    return tl.load(ptr + r, mask=r < REQS, other=missing)


@triton.jit
def _request_of(qsl_ptr, t, SLOTS, SEARCH_STEPS):
    """The request slot r of each row t, qsl[r] <= t < qsl[r + 1]: a binary search over the
    slots' starts, which never decrease (qsl[SLOTS] is the step's row count)."""
    lo = tl.zeros_like(t)
    hi = lo + SLOTS
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        below = tl.load(qsl_ptr + mid) <= t
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit
def _window_inputs(mixed_ptr, states_ptr, src, start, end, state_row, from_state, c, cmask,
                   stride_m, W1: tl.constexpr):  # fmt: skip
    """The convolution's inputs at token indices src [N] over channels c, each row in its own
    request (start, end, state_row, from_state: per row): rows of the chunk, or before the
    chunk's start columns of the slot's state (at state_row in states_ptr; zeros where
    from_state is false: a fresh request). Rows at or past end are zeros. [N, BLOCK_C] float32."""
    in_chunk = src >= start
    rows = (in_chunk & (src < end))[:, None] & cmask[None, :]
    x = tl.load(mixed_ptr + src[:, None] * stride_m + c[None, :], mask=rows, other=0.0)
    col = W1 + src - start  # the window never reaches before the state's first column
    before = ((~in_chunk) & from_state)[:, None] & cmask[None, :]
    at = states_ptr + state_row[:, None] + c[None, :] * W1 + col[:, None]
    s = tl.load(at, mask=before, other=0.0)
    return tl.where(in_chunk[:, None], x.to(tl.float32), s.to(tl.float32))


@triton.jit
def _store_window(dst_ptr, mixed_ptr, states_ptr, state_row, end, start, from_state, c, cmask,
                  stride_m, W1: tl.constexpr, BLOCK_W1: tl.constexpr):  # fmt: skip
    """The state of one request after its tokens before `end`: the last W - 1 inputs, into
    dst [C, W - 1]."""
    i = tl.arange(0, BLOCK_W1)
    zero = i * 0
    # per lane from the scalars (a mask of a vector and a loaded scalar does not interpret)
    window = _window_inputs(mixed_ptr, states_ptr, end - W1 + i, zero + start, zero + end,
                            zero.to(tl.int64) + state_row, zero + from_state.to(tl.int32) > 0,
                            c, cmask, stride_m, W1)  # fmt: skip
    mask = (i < W1)[:, None] & cmask[None, :]
    tl.store(dst_ptr + c[None, :] * W1 + i[:, None], window.to(dst_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


@triton.jit
def gdn_conv_kernel(
    mixed_ptr, weight_ptr, conv_states_ptr, conv_out_ptr, qsl_ptr, seq_lens_ptr, slots_ptr,
    REQS, T, C, stride_m, SLOTS, SEARCH_STEPS, W: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Depthwise causal convolution and SiLU of the step's rows program_id(0) * BLOCK_T on,
    channels block program_id(1), each row in its own request's window (the step's rows in
    parallel, whatever the requests): conv_out [T, C] float32, zeros for padding rows."""
    W1: tl.constexpr = W - 1
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    req = _request_of(qsl_ptr, t, SLOTS, SEARCH_STEPS)
    start, end = tl.load(qsl_ptr + req), tl.load(qsl_ptr + req + 1)
    slot = _per_request(slots_ptr, req, REQS, -1).to(tl.int64)
    live = (t < T) & (slot >= 0)
    end = tl.where(live, end, start)  # padding rows read nothing
    from_state = live & (_per_request(seq_lens_ptr, req, REQS, 0) != end - start)
    state_row = tl.where(live, slot, 0) * C * W1
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for i in tl.static_range(W):
        w = tl.load(weight_ptr + c * W + i, mask=cmask, other=0.0).to(tl.float32)
        x = _window_inputs(mixed_ptr, conv_states_ptr, t - W1 + i, start, end, state_row,
                           from_state, c, cmask, stride_m, W1)  # fmt: skip
        acc += w[None, :] * x
    tl.store(conv_out_ptr + t[:, None] * C + c[None, :], acc * tl.sigmoid(acc),
             mask=(t < T)[:, None] & cmask[None, :])  # fmt: skip


@triton.jit
def gdn_conv_state_kernel(
    mixed_ptr, conv_states_ptr, saved_conv_ptr, qsl_ptr, seq_lens_ptr, slots_ptr, at_ptr,
    entries_ptr, rows_ptr, REQS, C, stride_m, W: tl.constexpr, BLOCK_W1: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """The convolution's states request slot program_id(0) leaves, channels block
    program_id(1): a checkpoint's window, a verification's after each token, the slot's own
    after its tokens. Launched after the convolution, which read the slots' states as they were
    before the step."""
    W1: tl.constexpr = W - 1
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    start, end = tl.load(qsl_ptr + r), tl.load(qsl_ptr + r + 1)
    slot = _per_request(slots_ptr, r, REQS, -1).to(tl.int64)
    if (start < end) & (slot >= 0):
        n = end - start
        from_state = tl.load(seq_lens_ptr + r) != n  # not the request's first chunk
        row = slot * C * W1
        at, entry = tl.load(at_ptr + r), tl.load(entries_ptr + r).to(tl.int64)
        rows_at = tl.load(rows_ptr + r).to(tl.int64)
        if at > 0:
            _store_window(saved_conv_ptr + entry * C * W1, mixed_ptr, conv_states_ptr, row,
                          start + at, start, from_state, c, cmask, stride_m, W1,
                          BLOCK_W1)  # fmt: skip
        if rows_at >= 0:
            for j in range(1, n):
                _store_window(conv_states_ptr + (rows_at + j - 1) * C * W1, mixed_ptr,
                              conv_states_ptr, row, start + j, start, from_state, c, cmask,
                              stride_m, W1, BLOCK_W1)  # fmt: skip
        # the slot's own last: the windows above read it as it was
        _store_window(conv_states_ptr + row, mixed_ptr, conv_states_ptr, row, end, start,
                      from_state, c, cmask, stride_m, W1, BLOCK_W1)  # fmt: skip


@triton.jit
def _takes_chunks(n, rows_at, UP_TO: tl.constexpr):
    """Whether a request's rows go through the chunked rule: longer than a decode, and no
    state kept after each token (a verification's)."""
    return (n > UP_TO) & (rows_at < 0)


@triton.jit
def gdn_rule_kernel(
    conv_out_ptr, decay_ptr, beta_ptr, states_ptr, saved_ptr, out_ptr, qsl_ptr, seq_lens_ptr,
    slots_ptr, at_ptr, entries_ptr, rows_ptr, REQS, C, HV, KEY_OFFSET, q_scale,
    PER_KEY: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, UP_TO: tl.constexpr,
):  # fmt: skip
    """The gated delta rule token by token of request slot program_id(0), value head
    program_id(1), value columns block program_id(2), for the requests the chunked rule leaves:
    out [T, HV, DV], the state [HV, DK, DV] of its slot."""
    r, h = tl.program_id(0), tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask, vmask = kk < DK, vv < DV
    smask = kmask[:, None] & vmask[None, :]
    head_state = h * DK * DV + kk[:, None] * DV + vv[None, :]
    per_slot = HV * DK * DV
    start, end = tl.load(qsl_ptr + r), tl.load(qsl_ptr + r + 1)
    slot = _per_request(slots_ptr, r, REQS, -1).to(tl.int64)
    rows_at = _per_request(rows_ptr, r, REQS, -1).to(tl.int64)
    n = end - start
    if (start < end) & (slot < 0):  # padding rows
        for step in range(0, n):
            t = start.to(tl.int64) + step
            tl.store(out_ptr + (t * HV + h) * DV + vv,
                     tl.zeros([BLOCK_V], dtype=tl.float32), mask=vmask)  # fmt: skip
    if (start < end) & (slot >= 0) & (not _takes_chunks(n, rows_at, UP_TO)):
        fresh = tl.load(seq_lens_ptr + r) == n
        state = tl.load(states_ptr + slot * per_slot + head_state, mask=smask, other=0.0)
        state = tl.where(fresh, 0.0, state)
        at, entry = tl.load(at_ptr + r), tl.load(entries_ptr + r).to(tl.int64)
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


@triton.jit
def _unit_lower_inverse(a, ri, CHUNK: tl.constexpr):
    """(I + a)^-1 for a strictly lower-triangular a [CHUNK, CHUNK], row by row (forward
    substitution: row i is e_i minus a's row i times the rows above, which are final)."""
    inverse = tl.where(ri[:, None] == ri[None, :], 1.0, 0.0)
    for i in range(1, CHUNK):
        a_row = tl.sum(tl.where(ri[:, None] == i, a, 0.0), 0)
        correction = tl.sum(a_row[:, None] * inverse, 0)
        inverse = tl.where(ri[:, None] == i, inverse - correction[None, :], inverse)
    return inverse


@triton.jit
def gdn_chunk_prep_kernel(
    conv_out_ptr, decay_ptr, beta_ptr, w_ptr, u_ptr, gamma_ptr, qsl_ptr, slots_ptr, rows_ptr,
    REQS, T, C, HV, KEY_OFFSET, SLOTS, SEARCH_STEPS, PER_KEY: tl.constexpr, DK: tl.constexpr,
    DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr,
    UP_TO: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The state-free part of the chunked rule for rows program_id(0) * CHUNK on, value head
    program_id(1): gamma [T, HV] (the decay from the request's first row in the block), W
    [T, HV, DK] and U0 [T, HV, DV], for the rows of requests that take chunks."""
    h = tl.program_id(1)
    ri = tl.arange(0, CHUNK)
    t = tl.program_id(0).to(tl.int64) * CHUNK + ri
    req = _request_of(qsl_ptr, t, SLOTS, SEARCH_STEPS)
    n = tl.load(qsl_ptr + req + 1) - tl.load(qsl_ptr + req)
    slot = _per_request(slots_ptr, req, REQS, -1)
    live = (t < T) & (slot >= 0) & _takes_chunks(n, _per_request(rows_ptr, req, REQS, -1), UP_TO)
    if tl.max(live.to(tl.int32), 0) > 0:
        kk, dv = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_DV)
        kmask, dvmask = live[:, None] & (kk < DK)[None, :], live[:, None] & (dv < DV)[None, :]
        key_head = (h // PER_KEY) * DK
        k = tl.load(conv_out_ptr + t[:, None] * C + KEY_OFFSET + key_head + kk[None, :],
                    mask=kmask, other=0.0)  # fmt: skip
        k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        g = tl.load(decay_ptr + t * HV + h, mask=live, other=0.0)
        b = tl.load(beta_ptr + t * HV + h, mask=live, other=0.0)
        same = (req[:, None] == req[None, :]) & live[:, None] & live[None, :]
        gamma = tl.sum(tl.where(same & (ri[:, None] >= ri[None, :]), g[None, :], 0.0), 1)
        kk_t = tl.dot(k, tl.trans(k), input_precision=PRECISION)
        # exp only where j < i (a non-positive exponent): above the diagonal it may overflow
        exponent = tl.where(same & (ri[:, None] > ri[None, :]), gamma[:, None] - gamma[None, :],
                            float("-inf"))  # fmt: skip
        inverse = _unit_lower_inverse(b[:, None] * kk_t * tl.exp(exponent), ri, CHUNK)
        w = tl.dot(inverse, k * (b * tl.exp(gamma))[:, None], input_precision=PRECISION)
        v = tl.load(conv_out_ptr + t[:, None] * C + 2 * KEY_OFFSET + h * DV + dv[None, :],
                    mask=dvmask, other=0.0)  # fmt: skip
        u = tl.dot(inverse, v * b[:, None], input_precision=PRECISION)
        at_row = t * HV + h
        tl.store(w_ptr + at_row[:, None] * DK + kk[None, :], w, mask=kmask)
        tl.store(u_ptr + at_row[:, None] * DV + dv[None, :], u, mask=dvmask)
        tl.store(gamma_ptr + at_row, gamma, mask=live)


@triton.jit
def gdn_chunk_rule_kernel(
    conv_out_ptr, w_ptr, u_ptr, gamma_ptr, states_ptr, saved_ptr, out_ptr, qsl_ptr,
    seq_lens_ptr, slots_ptr, at_ptr, entries_ptr, rows_ptr, REQS, SLOTS, C, HV, KEY_OFFSET,
    q_scale, PER_KEY: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, CHUNK: tl.constexpr, UP_TO: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """The chunked rule's chain for value head program_id(1), value columns block
    program_id(2), and the request slots program_id(0) + i * num_programs(0) that take chunks
    (a grid of one program per slot would be mostly idle ones at decode: 8 warps each, per
    layer), over the blocks of CHUNK rows their tokens lie in (the first and last shared with
    the requests beside them): out [T, HV, DV], the slots' states."""
    h = tl.program_id(1)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    for r in range(tl.program_id(0), SLOTS, tl.num_programs(0)):
        start, end = tl.load(qsl_ptr + r), tl.load(qsl_ptr + r + 1)
        slot = _per_request(slots_ptr, r, REQS, -1).to(tl.int64)
        if (slot >= 0) & _takes_chunks(end - start, _per_request(rows_ptr, r, REQS, -1), UP_TO):
            fresh = tl.load(seq_lens_ptr + r) == end - start
            at, entry = tl.load(at_ptr + r), tl.load(entries_ptr + r).to(tl.int64)
            _chain(conv_out_ptr, w_ptr, u_ptr, gamma_ptr, states_ptr + slot * HV * DK * DV,
                   saved_ptr + entry * HV * DK * DV, out_ptr, start, end, fresh,
                   start + at - 1, at > 0, h, vv, C, HV, KEY_OFFSET, q_scale, PER_KEY, DK, DV,
                   BLOCK_K, CHUNK, PRECISION)  # fmt: skip


@triton.jit
def _chain(conv_out_ptr, w_ptr, u_ptr, gamma_ptr, state_ptr, saved_ptr, out_ptr, start, end,
           fresh, checkpoint, saves, h, vv, C, HV, KEY_OFFSET, q_scale, PER_KEY: tl.constexpr,
           DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
           PRECISION: tl.constexpr):  # fmt: skip
    """One request's chain for one head's columns vv: its state (state_ptr, the slot's) in
    registers from block to block; where `saves`, the state after row `checkpoint` into
    saved_ptr."""
    kk, ri = tl.arange(0, BLOCK_K), tl.arange(0, CHUNK)
    kmask, vmask = kk < DK, vv < DV
    smask = kmask[:, None] & vmask[None, :]
    head_state = h * DK * DV + kk[:, None] * DV + vv[None, :]
    state = tl.load(state_ptr + head_state, mask=smask, other=0.0)
    state = tl.where(fresh, 0.0, state)
    key_head = (h // PER_KEY) * DK
    for block in range(start // CHUNK, (end - 1) // CHUNK + 1):
        t = block * CHUNK + ri.to(tl.int64)
        live = (t >= start) & (t < end)
        lk = live[:, None] & kmask[None, :]
        row = conv_out_ptr + t[:, None] * C + key_head + kk[None, :]
        q = tl.load(row, mask=lk, other=0.0)
        q = q * (tl.rsqrt(tl.sum(q * q, 1) + 1e-6) * q_scale)[:, None]
        k = tl.load(row + KEY_OFFSET, mask=lk, other=0.0)
        k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        at_row = t * HV + h
        w = tl.load(w_ptr + at_row[:, None] * DK + kk[None, :], mask=lk, other=0.0)
        lv = live[:, None] & vmask[None, :]
        u = tl.load(u_ptr + at_row[:, None] * DV + vv[None, :], mask=lv, other=0.0)
        u -= tl.dot(w, state, input_precision=PRECISION)
        gamma = tl.load(gamma_ptr + at_row, mask=live, other=0.0)
        causal = live[:, None] & live[None, :] & (ri[:, None] >= ri[None, :])
        exponent = tl.where(causal, gamma[:, None] - gamma[None, :], float("-inf"))
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * tl.exp(exponent)
        o = tl.dot(q * tl.exp(gamma)[:, None], state, input_precision=PRECISION)
        o += tl.dot(scores, u, input_precision=PRECISION)
        tl.store(out_ptr + at_row[:, None] * DV + vv[None, :], o, mask=lv)
        if saves & (checkpoint >= block * CHUNK) & (checkpoint < block * CHUNK + CHUNK):
            saved = _state_after(state, k, u, gamma, live & (t <= checkpoint), t == checkpoint,
                                 PRECISION)  # fmt: skip
            tl.store(saved_ptr + head_state, saved, mask=smask)
        last = t == tl.minimum(end, block * CHUNK + CHUNK) - 1
        state = _state_after(state, k, u, gamma, live, last, PRECISION)
    tl.store(state_ptr + head_state, state, mask=smask)


@triton.jit
def _state_after(state, k, u, gamma, rows, last, PRECISION: tl.constexpr):
    """The state after row `last` of a block (a one-hot mask) from the state before it, with the
    corrections u of the block's `rows` up to it."""
    gamma_last = tl.sum(tl.where(last, gamma, 0.0), 0)
    k_to_last = tl.where(rows[:, None], k * tl.exp(gamma_last - gamma)[:, None], 0.0)
    return state * tl.exp(gamma_last) + tl.dot(tl.trans(k_to_last), u, input_precision=PRECISION)


def request_slots(num_tokens: int, query_start_loc: torch.Tensor) -> int:
    """Programs along the requests: at most one request per token, then the padding slot."""
    return min(num_tokens, query_start_loc.numel() - 2) + 1


def gdn_core_triton(
    mixed: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
    conv_states: torch.Tensor, recurrent_states: torch.Tensor, saved_conv: torch.Tensor,
    saved_recurrent: torch.Tensor, out: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, state_slots: torch.Tensor, checkpoint_at: torch.Tensor,
    checkpoint_entries: torch.Tensor, position_states: torch.Tensor, key_heads: int,
    key_dim: int, token_by_token_up_to: int = DECODE_RULE_UP_TO,
) -> None:  # fmt: skip
    """`kiln::gdn_core` from whole buffers (see StateBuffers): mixed [T, C] (q|k|v), decay and
    beta [T, HV] float32, out [T, HV, DV]; every tensor contiguous. Requests of at most
    `token_by_token_up_to` tokens take the recurrent form (the op's is the PyTorch core's;
    benchmarks/gdn_op.py raises it to time the recurrent form on prefills)."""
    tokens, channels = mixed.shape
    if tokens == 0:
        return
    _check_contiguous(mixed, decay, beta, conv_weight, conv_states, recurrent_states, out)
    value_heads, value_dim = out.shape[1], out.shape[2]
    slots = request_slots(tokens, query_start_loc)
    meta = (query_start_loc, seq_lens, state_slots, checkpoint_at, checkpoint_entries,
            position_states, state_slots.numel())  # fmt: skip
    conv_out = torch.empty(tokens, channels, dtype=torch.float32, device=mixed.device)
    width, search = conv_weight.shape[-1], (slots, (slots - 1).bit_length())
    block_c = min(CONV_CHANNELS, triton.next_power_of_2(channels))
    channel_blocks = triton.cdiv(channels, block_c)
    gdn_conv_kernel[(triton.cdiv(tokens, CONV_TOKENS), channel_blocks)](
        mixed, conv_weight, conv_states, conv_out, query_start_loc, seq_lens, state_slots,
        meta[-1], tokens, channels, mixed.stride(0), *search, W=width, BLOCK_T=CONV_TOKENS,
        BLOCK_C=block_c,
    )  # fmt: skip
    gdn_conv_state_kernel[(slots, channel_blocks)](
        mixed, conv_states, saved_conv, *meta, channels, mixed.stride(0), W=width,
        BLOCK_W1=triton.next_power_of_2(max(width - 1, 1)), BLOCK_C=block_c,
    )  # fmt: skip
    heads = (channels, value_heads, key_heads * key_dim)
    shapes = dict(PER_KEY=value_heads // key_heads, DK=key_dim, DV=value_dim,
                  BLOCK_K=max(16, triton.next_power_of_2(key_dim)),
                  UP_TO=token_by_token_up_to)  # fmt: skip
    _chunked_rule(conv_out, decay, beta, recurrent_states, saved_recurrent, out, meta, slots,
                  heads, shapes)  # fmt: skip
    block_v = min(32, triton.next_power_of_2(value_dim))
    gdn_rule_kernel[(slots, value_heads, triton.cdiv(value_dim, block_v))](
        conv_out, decay, beta, recurrent_states, saved_recurrent, out, *meta, *heads,
        key_dim**-0.5, BLOCK_V=block_v, **shapes,
    )  # fmt: skip


def _chunked_rule(conv_out, decay, beta, recurrent_states, saved_recurrent, out, meta,
                  slots: int, heads: tuple, shapes: dict) -> None:  # fmt: skip
    """The prep over every block of the step's rows, then the chain per request: both find
    the requests that take chunks on the device (the rest of their programs return)."""
    tokens, (value_heads, value_dim) = conv_out.shape[0], out.shape[1:]
    key_dim = shapes["DK"]
    scratch = dict(dtype=torch.float32, device=conv_out.device)
    w = torch.empty(tokens, value_heads, key_dim, **scratch)
    u = torch.empty(tokens, value_heads, value_dim, **scratch)
    gamma = torch.empty(tokens, value_heads, **scratch)
    qsl, state_slots, position_states, requests = meta[0], meta[2], meta[5], meta[6]
    common = dict(CHUNK=CHUNK, PRECISION=PRECISION, num_warps=CHUNK_WARPS, **shapes)
    gdn_chunk_prep_kernel[(triton.cdiv(tokens, CHUNK), value_heads)](
        conv_out, decay, beta, w, u, gamma, qsl, state_slots, position_states, requests, tokens,
        heads[0], value_heads, heads[2], slots, (slots - 1).bit_length(),
        BLOCK_DV=max(16, triton.next_power_of_2(value_dim)), **common,
    )  # fmt: skip
    block_v = max(16, min(CHAIN_VALUES, triton.next_power_of_2(value_dim)))
    # programs along the requests: one per block of the step's rows (at most one per slot),
    # each taking the slots at its stride in turn; a decode step's few blocks keep it small
    chains = min(slots, triton.cdiv(tokens, CHUNK))
    gdn_chunk_rule_kernel[(chains, value_heads, triton.cdiv(value_dim, block_v))](
        conv_out, w, u, gamma, recurrent_states, saved_recurrent, out, *meta, slots, *heads,
        key_dim**-0.5, BLOCK_V=block_v, **common,
    )  # fmt: skip


def _check_contiguous(*tensors: torch.Tensor) -> None:
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("the Triton Gated DeltaNet core takes contiguous tensors")


_LIB = torch.library.Library("kiln", "FRAGMENT")
register_gdn_core(_LIB, "gdn_core_triton", gdn_core_triton)
