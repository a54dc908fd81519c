"""The Gated DeltaNet layer of Qwen3-Next and Qwen3.5: a linear-attention token mixer whose
memory of the past is a fixed-size state per sequence (the last inputs of a causal
convolution, and the delta rule's matrix per value head) instead of a KV cache.

    q, k, v, z, b, a = in_proj_qkvz(x), in_proj_ba(x)   (Qwen3-Next: grouped by key head)
                     = in_proj_qkv(x), in_proj_z(x), in_proj_b(x), in_proj_a(x)   (Qwen3.5)
    q, k, v = SiLU(causal_conv(q, k, v))                 (depthwise, continuing from the state)
    g = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b)
    o = gated_delta_rule(l2norm(q) / sqrt(dk), l2norm(k), v, g, beta)   (float32)
    out_proj(RMSNorm(o) * SiLU(z))

The states live in two tensors per layer that the runner allocates and binds, indexed by the
sequence's state slot; `StateMetadata` says which rows of the step belong to which slot.

The convolution and the delta rule (reading and writing the slots) are one registered op, a
splitting op of compiled graphs like attention; the projections and norms around it are
compiled. Two implementations, chosen by the attention backend's `state_core`:
`kiln::gdn_core` here, in PyTorch (the CPU's, and the reference), whose per-request loop asks
the host for the batch's shape, so it runs eagerly between compiled pieces and is never inside
a CUDA graph; and `kiln::gdn_core_triton` (gdn_triton.py, beside the Triton attention backend),
two launches from whole buffers that every graph mode captures (`GDN_GRAPH_SUPPORT`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.attention.backend import StateMetadata
from kiln.config.graph_plan import GraphSupport
from kiln.layers import delta_rule
from kiln.layers.linear import Linear
from kiln.layers.norm import GatedRMSNorm

DECODE_RULE_UP_TO = 4  # tokens a request computes token by token; longer: in blocks
GDN_OPS = {"torch": "kiln::gdn_core", "triton": "kiln::gdn_core_triton"}
# the PyTorch core reads the batch's shape on the host; the Triton core reads none
GDN_GRAPH_SUPPORT = {"torch": GraphSupport.NEVER, "triton": GraphSupport.ALWAYS}


class GatedDeltaNet(nn.Module):
    def __init__(
        self, hidden: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
        conv_kernel: int, eps: float, grouped_projections: bool = True, core: str = "torch",
    ) -> None:  # fmt: skip
        """`grouped_projections`: Qwen3-Next's two input matrices (rows grouped by key head);
        else Qwen3.5's four (q/k/v flat, then z, b and a). `core`: "torch" or "triton"."""
        super().__init__()
        if core not in GDN_OPS:
            raise ValueError(f"the Gated DeltaNet core is one of {list(GDN_OPS)}, not {core!r}")
        self.core = core
        self.key_heads, self.value_heads = key_heads, value_heads
        self.key_dim, self.value_dim = key_dim, value_dim
        self.conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
        self.grouped = grouped_projections
        if grouped_projections:
            self.in_proj_qkvz = Linear(hidden, self.conv_dim + value_heads * value_dim)
            self.in_proj_ba = Linear(hidden, 2 * value_heads)
        else:
            self.in_proj_qkv = Linear(hidden, self.conv_dim)
            self.in_proj_z = Linear(hidden, value_heads * value_dim)
            self.in_proj_b = Linear(hidden, value_heads)
            self.in_proj_a = Linear(hidden, value_heads)
        self.conv1d = nn.Module()  # holds `weight` [conv_dim, 1, kernel], HF's name and shape
        self.conv1d.weight = nn.Parameter(
            torch.empty(self.conv_dim, 1, conv_kernel), requires_grad=False
        )
        self.A_log = nn.Parameter(torch.empty(value_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(value_heads), requires_grad=False)
        self.norm = GatedRMSNorm(value_dim, eps)
        self.out_proj = Linear(value_heads * value_dim, hidden)
        self.conv_states: torch.Tensor | None = None  # [slots, conv_dim, kernel - 1]
        self.recurrent_states: torch.Tensor | None = None  # [slots, value heads, dk, dv] fp32
        self.saved_conv: torch.Tensor | None = None  # the same, per prefix-cache checkpoint
        self.saved_recurrent: torch.Tensor | None = None

    def bind_states(
        self, conv_states: torch.Tensor, recurrent_states: torch.Tensor,
        saved_conv: torch.Tensor, saved_recurrent: torch.Tensor,
    ) -> None:  # fmt: skip
        """The slots' states (then, with speculative decoding, the rows where verified runs
        keep their state after each token), and the prefix cache's checkpoints of them (none:
        0 rows)."""
        self.conv_states, self.recurrent_states = conv_states, recurrent_states
        self.saved_conv, self.saved_recurrent = saved_conv, saved_recurrent

    def _project(self, x: torch.Tensor):
        """(q|k|v [T, conv_dim], z [T, hv * dv], b [T, hv], a [T, hv]). Explicit sizes, never
        -1 beside the token count: Dynamo traces that as an unbacked size and guards on it."""
        tokens, hk, hv = x.shape[0], self.key_heads, self.value_heads
        dk, dv, per_key = self.key_dim, self.value_dim, hv // hk
        if not self.grouped:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        qkvz = self.in_proj_qkvz(x).view(tokens, hk, 2 * dk + 2 * per_key * dv)
        q, k, v, z = qkvz.split([dk, dk, per_key * dv, per_key * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(tokens, hk, 2 * per_key).split(per_key, dim=-1)
        mixed = torch.cat([q.reshape(tokens, hk * dk), k.reshape(tokens, hk * dk),
                           v.reshape(tokens, hv * dv)], dim=-1)  # fmt: skip
        return mixed, z.reshape(tokens, hv * dv), b.reshape(tokens, hv), a.reshape(tokens, hv)

    def forward(self, x: torch.Tensor, state: StateMetadata) -> torch.Tensor:
        tokens, hv, dv = x.shape[0], self.value_heads, self.value_dim
        mixed, z, b, a = self._project(x)
        beta = b.float().sigmoid()
        decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if self.conv_states is None or self.recurrent_states is None:
            raise RuntimeError("the Gated DeltaNet states were not bound before a forward")
        # allocated here, in the compiled piece before the op (as attention's output)
        core = x.new_empty(tokens, self.value_heads, dv)
        layer = (mixed.contiguous(), decay.contiguous(), beta.contiguous(), self.conv1d.weight,
                 self.conv_states, self.recurrent_states, self.saved_conv, self.saved_recurrent,
                 core)  # fmt: skip
        # the Triton core (registered by the Triton attention backend's module) reads the same
        # metadata from the whole buffers
        meta = state.buffers if self.core == "triton" else state
        if meta is None:
            raise RuntimeError("the Triton Gated DeltaNet core needs the state buffers")
        op = torch.ops.kiln.gdn_core_triton if self.core == "triton" else torch.ops.kiln.gdn_core
        op(*layer, meta.query_start_loc, meta.seq_lens, meta.state_slots, meta.checkpoint_at,
           meta.checkpoint_entries, meta.position_states, self.key_heads, self.key_dim)  # fmt: skip
        # per head over [tokens, hv, dv], not flattened to [tokens * hv, dv]: Inductor cannot
        # split an unbacked token count's [T, hv * dv] into [hv * T, dv] without guarding T == 1
        # (a retrace after a saved guard failed crashed on that guard)
        out = self.norm(core, z.reshape(tokens, hv, dv))
        return self.out_proj(out.view(tokens, hv * dv))


def _gdn_core(
    mixed: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
    conv_states: torch.Tensor, recurrent_states: torch.Tensor, saved_conv: torch.Tensor,
    saved_recurrent: torch.Tensor, out: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, state_slots: torch.Tensor, checkpoint_at: torch.Tensor,
    checkpoint_entries: torch.Tensor, position_states: torch.Tensor, key_heads: int,
    key_dim: int,
) -> None:  # fmt: skip
    """Convolution and delta rule per request, each reading and writing its state slot (a
    request's first chunk starts from an empty state), the state copied into a checkpoint
    after `checkpoint_at` of a request's tokens where one is asked for, and, where
    `position_states` gives a row (else -1), after its j-th token into that row + j - 1, for
    each token but the last; rows past the requests' (padding up to a graph's size) are
    zero."""
    starts = query_start_loc.tolist()
    out[starts[-1] :].zero_()
    step = zip(starts, starts[1:], seq_lens.tolist(), state_slots.tolist(),
               checkpoint_at.tolist(), checkpoint_entries.tolist(),
               position_states.tolist())  # fmt: skip
    for start, end, length, slot, at, entry, positions_at in step:
        if length == end - start:  # nothing before this chunk
            conv_states[slot].zero_()
            recurrent_states[slot].zero_()
        split = start + at if at > 0 else end
        for a, b in ((start, split), (split, end)):
            if a < b:
                after = _one_request(mixed, decay, beta, conv_weight, conv_states,
                                     recurrent_states, out, a, b, slot, key_heads, key_dim,
                                     positions_at >= 0)  # fmt: skip
                for j, (conv, recurrent) in enumerate(after, start=a - start + 1):
                    if j < end - start:  # the last one is the slot's own
                        conv_states[positions_at + j - 1] = conv
                        recurrent_states[positions_at + j - 1] = recurrent
            if b == split and at > 0:
                saved_conv[entry] = conv_states[slot]
                saved_recurrent[entry] = recurrent_states[slot]


def _one_request(
    mixed, decay, beta, conv_weight, conv_states, recurrent_states, out, start: int, end: int,
    slot: int, key_heads: int, key_dim: int, per_position: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Rows [start, end) of one request, continuing from its slot's state. With
    `per_position`, token by token, and returns the (conv, recurrent) state after each."""
    before = conv_states[slot]
    # the convolution's inputs, its state first: its window after j tokens ends at the j-th
    inputs = torch.cat([before, mixed[start:end].t()], dim=1) if per_position else None
    conv, conv_states[slot] = delta_rule.causal_conv(mixed[start:end], conv_weight[:, 0], before)
    q, k, v = _heads(conv, key_heads, key_dim, out.shape[1], out.shape[2])
    g, b = decay[start:end].t(), beta[start:end].t()
    if per_position:
        recurrent: list[torch.Tensor] = []
        o, recurrent_states[slot] = delta_rule.recurrent(q, k, v, g, b, recurrent_states[slot],
                                                         recurrent)  # fmt: skip
    else:
        rule = delta_rule.recurrent if end - start <= DECODE_RULE_UP_TO else delta_rule.chunked
        o, recurrent_states[slot] = rule(q, k, v, g, b, recurrent_states[slot])
    out[start:end] = o.transpose(0, 1).to(out.dtype)
    if inputs is None:
        return []
    width = before.shape[1]
    return [(inputs[:, j : j + width], s) for j, s in enumerate(recurrent, start=1)]


def _heads(conv: torch.Tensor, key_heads: int, key_dim: int, value_heads: int, value_dim: int):
    """q, k, v as [value heads, tokens, dim] float32, q and k L2-normalised, q scaled; each key
    head serves value_heads / key_heads consecutive value heads."""
    tokens = conv.shape[0]
    q, k, v = conv.float().split([key_heads * key_dim] * 2 + [value_heads * value_dim], -1)
    q = delta_rule.l2_normalize(q.view(tokens, key_heads, key_dim)) * key_dim**-0.5
    k = delta_rule.l2_normalize(k.view(tokens, key_heads, key_dim))
    per_key = value_heads // key_heads
    q, k = (t.repeat_interleave(per_key, dim=1).transpose(0, 1) for t in (q, k))
    return q, k, v.view(tokens, value_heads, value_dim).transpose(0, 1)


# both cores' schema: the layer's tensors (the states and out written), the step's metadata,
# the key heads' shape
GDN_CORE_SCHEMA = (
    "(Tensor mixed, Tensor decay, Tensor beta, Tensor conv_weight, "
    "Tensor(a!) conv_states, Tensor(b!) recurrent_states, Tensor(c!) saved_conv, "
    "Tensor(d!) saved_recurrent, Tensor(e!) out, Tensor query_start_loc, Tensor seq_lens, "
    "Tensor state_slots, Tensor checkpoint_at, Tensor checkpoint_entries, "
    "Tensor position_states, int key_heads, int key_dim) -> ()"
)


def register_gdn_core(lib: torch.library.Library, name: str, impl) -> None:
    lib.define(name + GDN_CORE_SCHEMA)
    lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"kiln::{name}", lambda *args: None, lib=lib)


_LIB = torch.library.Library("kiln", "FRAGMENT")
register_gdn_core(_LIB, "gdn_core", _gdn_core)
