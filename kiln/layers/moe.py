"""A sparse mixture-of-experts MLP: a softmax top-k router, SwiGLU experts stored stacked, and an
optional shared expert behind a sigmoid gate (Qwen3-Next, Qwen3.5-MoE).

The experts' weights are two stacked tensors, `gate_up_proj` [experts, 2 * intermediate, hidden]
and `down_proj` [experts, hidden, intermediate] (HF's in-memory layout), so that expert
parallelism is a slice of dimension 0 and a quantized implementation replaces two tensors.
The routed rows are sorted by expert, so a step runs one matmul per active expert, never one
per token. That product is one custom op, `kiln::moe_experts`, which Dynamo does not trace
into: its grouping is data-dependent, and the graph around it stays one compiled piece."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.layers.linear import Linear
from kiln.layers.mlp import SwiGLU


def _sorted_by_expert(ids: torch.Tensor, num_experts: int):
    """(the token of each routed row, the rows' order, tokens per expert), rows sorted by
    expert."""
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order // ids.shape[1], order, counts


def experts_by_loop(x, gate_up, down, ids, weights) -> torch.Tensor:
    """One matmul pair per active expert; the counts come to the host (free on the CPU, a sync
    on CUDA, where it cannot be captured)."""
    tokens, order, counts = _sorted_by_expert(ids, gate_up.shape[0])
    routed, start = x[tokens], 0
    out = torch.empty_like(routed)
    for expert, count in enumerate(counts.tolist()):
        if count:
            rows = slice(start, start + count)
            gate, up = F.linear(routed[rows], gate_up[expert]).chunk(2, dim=-1)
            out[rows] = F.linear(F.silu(gate) * up, down[expert])
            start += count
    return _combine(x, out, tokens, order, weights)


def experts_grouped(x, gate_up, down, ids, weights) -> torch.Tensor:
    """The same through `torch._grouped_mm` with the group ends on the device: no host sync,
    so it is capturable in a CUDA graph."""
    tokens, order, counts = _sorted_by_expert(ids, gate_up.shape[0])
    ends = counts.cumsum(0, dtype=torch.int32)
    hidden = torch._grouped_mm(x[tokens], gate_up.transpose(1, 2), offs=ends)
    gate, up = hidden.chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=ends)
    return _combine(x, out, tokens, order, weights)


def _combine(x, routed_out, tokens, order, weights) -> torch.Tensor:
    routed_out = routed_out * weights.reshape(-1)[order, None]
    return x.new_zeros(x.shape).index_add_(0, tokens, routed_out)


def _moe_experts(x, gate_up, down, ids, weights) -> torch.Tensor:
    if x.device.type == "cpu":
        return experts_by_loop(x, gate_up, down, ids, weights)
    return experts_grouped(x, gate_up, down, ids, weights)


_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define(
    "moe_experts(Tensor x, Tensor gate_up, Tensor down, Tensor ids, Tensor weights) -> Tensor"
)
_LIB.impl("moe_experts", _moe_experts, "CompositeExplicitAutograd")
torch.library.register_fake(
    "kiln::moe_experts", lambda x, gate_up, down, ids, weights: torch.empty_like(x), lib=_LIB
)


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden, intermediate), requires_grad=False
        )

    def part(self, expert: int, proj: str) -> torch.Tensor:
        """The rows one checkpoint tensor of one expert fills (gate_proj, up_proj, down_proj)."""
        if proj == "down_proj":
            return self.down_proj[expert]
        rows = slice(0, self.intermediate)
        if proj == "up_proj":
            rows = slice(self.intermediate, None)
        return self.gate_up_proj[expert, rows]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.ops.kiln.moe_experts(x, self.gate_up_proj, self.down_proj, ids, weights)


class SparseMoE(nn.Module):
    """`shared`: the shared expert's intermediate size, 0 for none."""

    def __init__(
        self, hidden: int, num_experts: int, top_k: int, intermediate: int,
        norm_topk_prob: bool, shared: int,
    ) -> None:  # fmt: skip
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = Linear(hidden, num_experts)
        self.experts = FusedExperts(num_experts, hidden, intermediate)
        self.shared_expert = SwiGLU(hidden, shared) if shared else None
        self.shared_expert_gate = Linear(hidden, 1) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).float().softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, ids, weights.to(x.dtype))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
