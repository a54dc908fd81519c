"""Routing a step's rows to experts: the rows sorted by expert (so a step runs one product per
active expert, never one per token) and their outputs combined back per token with the router's
weights. Shared by the dense experts (kiln/layers/moe.py) and the packed ones
(kiln/layers/packed_experts_op.py, for steps of many rows; a decode step's packed experts are
routed in the kernels' C code, csrc/moe_route.h)."""

from __future__ import annotations

import torch


def sorted_by_expert(ids: torch.Tensor, num_experts: int):
    """(the token of each routed row, the rows' order, tokens per expert), rows sorted by
    expert."""
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order // ids.shape[1], order, counts


def experts_loop(x, ids, weights, num_experts: int, project) -> torch.Tensor:
    """The routed rows sorted by expert, `project(rows, expert)` once per active expert; the
    counts come to the host (free on the CPU, a sync on CUDA, where it cannot be captured)."""
    tokens, order, counts = sorted_by_expert(ids, num_experts)
    routed, start = x[tokens], 0
    out = torch.empty_like(routed)
    for expert, count in enumerate(counts.tolist()):
        if count:
            out[start : start + count] = project(routed[start : start + count], expert)
            start += count
    return combine(x, out, tokens, order, weights)


def combine(x, routed_out, tokens, order, weights) -> torch.Tensor:
    routed_out = routed_out * weights.reshape(-1)[order, None]
    return x.new_zeros(x.shape).index_add_(0, tokens, routed_out)
