"""A sparse mixture-of-experts MLP: a softmax top-k router, SwiGLU experts stored stacked, and an
optional shared expert behind a sigmoid gate (Qwen3-Next, Qwen3.5-MoE).

The experts' weights are two stacked tensors, `gate_up_proj` [experts, 2 * intermediate, hidden]
and `down_proj` [experts, hidden, intermediate] (HF's in-memory layout), so that expert
parallelism is a slice of dimension 0 and a quantized implementation replaces two tensors.
The routed rows are sorted by expert, so a step runs one matmul per active expert, never one
per token. That product is one custom op, `kiln::moe_experts`, which Dynamo does not trace
into: its grouping is data-dependent, and the graph around it stays one compiled piece.
Quantized experts stay packed per stack (kiln/layers/packed_experts.py) and run through
`kiln::moe_experts_packed` (kiln/layers/packed_experts_op.py): on the CPU one kernel call per
projection for a step's experts, with a decode step's routing in the kernel's C code; on CUDA
one grouped Triton launch per projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.errors import ModelLoadError
from kiln.layers import packed_experts_op
from kiln.layers.expert_routing import combine, experts_loop, sorted_by_expert
from kiln.layers.linear import Linear
from kiln.layers.mlp import SwiGLU
from kiln.layers.packed import QuantizedTensor
from kiln.layers.packed_experts import DENSE_FORM, ExpertPacker


def experts_by_loop(x, gate_up, down, ids, weights) -> torch.Tensor:
    """One matmul pair per active expert."""

    def project(rows: torch.Tensor, expert: int) -> torch.Tensor:
        gate, up = F.linear(rows, gate_up[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down[expert])

    return experts_loop(x, ids, weights, gate_up.shape[0], project)


def experts_grouped(x, gate_up, down, ids, weights) -> torch.Tensor:
    """The same through `torch._grouped_mm` with the group ends on the device: no host sync,
    so it is capturable in a CUDA graph."""
    tokens, order, counts = sorted_by_expert(ids, gate_up.shape[0])
    ends = counts.cumsum(0, dtype=torch.int32)
    hidden = torch._grouped_mm(x[tokens], gate_up.transpose(1, 2), offs=ends)
    gate, up = hidden.chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=ends)
    return combine(x, out, tokens, order, weights)


def experts_by_triton(x, gate_up, down, ids, weights) -> torch.Tensor:
    """The same in kiln's Triton kernel (kiln/layers/moe_triton.py): capturable in every dtype."""
    from kiln.layers.moe_triton import experts_triton  # triton: a CUDA dependency

    tokens, order, counts = sorted_by_expert(ids, gate_up.shape[0])
    out = experts_triton(x[tokens], gate_up, down, counts)
    return combine(x, out, tokens, order, weights)


def grouped_mm_captures(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs on the device for x (bf16 from Hopper on); elsewhere its
    fallback brings the group ends to the host, which a CUDA graph cannot capture."""
    return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9


def _moe_experts(x, gate_up, down, ids, weights) -> torch.Tensor:
    if x.device.type == "cpu":
        return experts_by_loop(x, gate_up, down, ids, weights)
    if grouped_mm_captures(x):
        return experts_grouped(x, gate_up, down, ids, weights)
    return experts_by_triton(x, gate_up, down, ids, weights)


_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define(
    "moe_experts(Tensor x, Tensor gate_up, Tensor down, Tensor ids, Tensor weights) -> Tensor"
)
_LIB.impl("moe_experts", _moe_experts, "CompositeExplicitAutograd")
torch.library.register_fake(
    "kiln::moe_experts", lambda x, gate_up, down, ids, weights: torch.empty_like(x), lib=_LIB
)


# a projection's stack -> the checkpoint parts it is made of, stacked by rows in this order
PROJECTIONS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class FusedExperts(nn.Module):
    """The experts' two stacks, dense or kept packed per stack (`packed`)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden, intermediate), requires_grad=False
        )
        self.packed = nn.ModuleDict()  # stack name -> PackedExperts
        self.packers: dict[str, ExpertPacker] = {}  # stacks being packed while loading
        self.fallback_reasons: dict[str, str] = {}  # stack -> why its quantized parts are dense

    def part(self, expert: int, proj: str) -> torch.Tensor:
        """The rows one checkpoint tensor of one expert fills (gate_proj, up_proj, down_proj)."""
        stack = _stack_of(proj)
        if stack in self.packed:
            raise ModelLoadError(f"expert {expert}'s {proj} arrived twice")
        if proj == "down_proj":
            return self.down_proj[expert]
        rows = slice(0, self.intermediate)
        if proj == "up_proj":
            rows = slice(self.intermediate, None)
        return self.gate_up_proj[expert, rows]

    def load_quantized(self, expert: int, proj: str, t: QuantizedTensor) -> None:
        """Take one expert's quantized part: packed with the others where a kernel runs them
        all, else dequantized into the dense stack."""
        stack = _stack_of(proj)
        if stack in self.fallback_reasons:
            self.part(expert, proj).copy_(t.dequantize())
            return
        packer = self.packers.setdefault(
            stack, ExpertPacker(self.num_experts, PROJECTIONS[stack], getattr(self, stack).device)
        )
        if packer.reason is None:
            packer.add(expert, proj, t)  # a part it cannot pack stays in its `parts`
        else:  # no kernel on this device: known before the first part
            self.part(expert, proj).copy_(t.dequantize())
        if packer.reason is not None:
            self._fall_back(stack, packer.reason)
        elif packer.complete:
            self.packed[stack] = packer.stack()
            del self.packers[stack]
            setattr(self, stack, None)  # the dense stack's pages were never written

    def load_dense(self, expert: int, proj: str, t: torch.Tensor) -> None:
        """Take one expert's dense part; a stack being packed is dequantized instead."""
        stack = _stack_of(proj)
        if stack in self.packers:
            self._fall_back(stack, "not every expert arrived quantized")
        self.part(expert, proj).copy_(t)

    def _fall_back(self, stack: str, reason: str) -> None:
        """The stack dense from here on: what its packer holds, dequantized into it."""
        packer = self.packers.pop(stack)
        self.fallback_reasons[stack] = reason
        dense = getattr(self, stack)
        for e, w in packer.dense_experts().items():
            dense.data[e].copy_(w)
        for e, parts in packer.parts.items():
            for proj, t in parts.items():
                self.part(e, proj).copy_(t.dequantize())

    def finalize(self, device: torch.device) -> None:
        """Stacks whose experts did not all arrive (the loader names the missing tensors):
        what they hold, dequantized into the dense stack."""
        for stack in list(self.packers):
            self._fall_back(stack, "not every expert arrived quantized")

    def _operand(self, stack: str) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        """(tensors, scale tables, form) of one stack, as `kiln::moe_experts_packed` takes it."""
        if stack in self.packed:
            packed, scales_zeros = self.packed[stack].planes()
            return packed, scales_zeros, self.packed[stack].form
        return [getattr(self, stack)], [], DENSE_FORM

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return torch.ops.kiln.moe_experts(x, self.gate_up_proj, self.down_proj, ids, weights)
        gate_up, gate_up_sz, gate_up_form = self._operand("gate_up_proj")
        down, down_sz, down_form = self._operand("down_proj")
        int8_planes = max(m.int8_planes for m in self.packed.values())  # one policy for all
        # eager: the implementation itself, where the dispatcher's unboxing of four tensor lists
        # cost ~40-90 us a layer of a Qwen3-30B-A3B decode step; the op while tracing, and while
        # the profiler records, so a profile names it (benchmarks/decode_step.py)
        through_op = torch.compiler.is_compiling() or torch.autograd._profiler_enabled()
        experts = (torch.ops.kiln.moe_experts_packed if through_op
                   else packed_experts_op._moe_experts_packed)  # fmt: skip
        return experts(
            x, gate_up, gate_up_sz, down, down_sz, [gate_up_form, down_form],
            self.intermediate, ids, weights, int8_planes,
        )  # fmt: skip


def _stack_of(proj: str) -> str:
    return "down_proj" if proj == "down_proj" else "gate_up_proj"


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
