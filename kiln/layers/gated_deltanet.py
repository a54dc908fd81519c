"""The Gated DeltaNet layer of Qwen3-Next and Qwen3.5: a linear-attention token mixer whose
memory of the past is a fixed-size state per sequence (the last inputs of a causal
convolution, and the delta rule's matrix per value head) instead of a KV cache.

    q, k, v, z, b, a = in_proj_qkvz(x), in_proj_ba(x)   (grouped by key head, as HF stores it)
    q, k, v = SiLU(causal_conv(q, k, v))                 (depthwise, continuing from the state)
    g = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b)
    o = gated_delta_rule(l2norm(q) / sqrt(dk), l2norm(k), v, g, beta)   (float32)
    out_proj(RMSNorm(o) * SiLU(z))

The states live in two tensors per layer that the runner allocates and binds, indexed by the
sequence's state slot; `StateRows` says which rows of the step belong to which slot."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.attention.backend import StateRows
from kiln.layers import delta_rule
from kiln.layers.linear import Linear
from kiln.layers.norm import GatedRMSNorm

DECODE_RULE_UP_TO = 4  # tokens a request computes token by token; longer: in blocks


class GatedDeltaNet(nn.Module):
    def __init__(
        self, hidden: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
        conv_kernel: int, eps: float,
    ) -> None:  # fmt: skip
        super().__init__()
        self.key_heads, self.value_heads = key_heads, value_heads
        self.key_dim, self.value_dim = key_dim, value_dim
        self.conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
        self.in_proj_qkvz = Linear(hidden, 2 * key_heads * key_dim + 2 * value_heads * value_dim)
        self.in_proj_ba = Linear(hidden, 2 * value_heads)
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

    def bind_states(self, conv_states: torch.Tensor, recurrent_states: torch.Tensor) -> None:
        self.conv_states, self.recurrent_states = conv_states, recurrent_states

    def forward(self, x: torch.Tensor, rows: StateRows) -> torch.Tensor:
        tokens, per_key = x.shape[0], self.value_heads // self.key_heads
        dk, dv = self.key_dim, self.value_dim
        qkvz = self.in_proj_qkvz(x).view(tokens, self.key_heads, -1)
        q, k, v, z = qkvz.split([dk, dk, per_key * dv, per_key * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(tokens, self.key_heads, -1).split(per_key, dim=-1)
        mixed = torch.cat([t.reshape(tokens, -1) for t in (q, k, v)], dim=-1)
        beta = b.reshape(tokens, -1).float().sigmoid()
        decay = -self.A_log.float().exp() * F.softplus(a.reshape(tokens, -1).float() + self.dt_bias)
        core = self._core(mixed, decay, beta, rows)  # [tokens, value heads, dv]
        out = self.norm(core.reshape(-1, dv), z.reshape(-1, dv))
        return self.out_proj(out.view(tokens, -1))

    def _core(self, mixed, decay, beta, rows: StateRows) -> torch.Tensor:
        """Convolution and delta rule per request, each reading and writing its state slot;
        rows after the requests' (padding) stay zero."""
        if self.conv_states is None or self.recurrent_states is None:
            raise RuntimeError("the Gated DeltaNet states were not bound before a forward")
        out = mixed.new_zeros(mixed.shape[0], self.value_heads, self.value_dim)
        weight = self.conv1d.weight[:, 0]
        for start, end, slot, fresh in rows.rows:
            if fresh:
                self.conv_states[slot].zero_()
                self.recurrent_states[slot].zero_()
            conv, self.conv_states[slot] = delta_rule.causal_conv(
                mixed[start:end], weight, self.conv_states[slot]
            )
            q, k, v = self._heads(conv)
            rule = delta_rule.recurrent if end - start <= DECODE_RULE_UP_TO else delta_rule.chunked
            o, self.recurrent_states[slot] = rule(
                q, k, v, decay[start:end].t(), beta[start:end].t(), self.recurrent_states[slot]
            )
            out[start:end] = o.transpose(0, 1).to(out.dtype)
        return out

    def _heads(self, conv: torch.Tensor):
        """q, k, v as [value heads, tokens, dim] float32, q and k L2-normalised, q scaled; each
        key head serves value_heads / key_heads consecutive value heads."""
        tokens, hk, dk = conv.shape[0], self.key_heads, self.key_dim
        q, k, v = conv.float().split([hk * dk, hk * dk, self.value_heads * self.value_dim], -1)
        per_key = self.value_heads // hk
        q = delta_rule.l2_normalize(q.view(tokens, hk, dk)) * dk**-0.5
        k = delta_rule.l2_normalize(k.view(tokens, hk, dk))
        q, k = (t.repeat_interleave(per_key, dim=1).transpose(0, 1) for t in (q, k))
        return q, k, v.view(tokens, self.value_heads, self.value_dim).transpose(0, 1)
