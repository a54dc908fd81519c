"""Compilation and CUDA graphs: the configuration, the graph plan resolved from it, the split
backend for torch.compile, the compile cache and the runtime dispatcher."""

from kiln.compilation.config import CompilationConfig, CUDAGraphMode
from kiln.compilation.plan import (
    AttentionCaps,
    DeviceCaps,
    GraphPlan,
    PlanChange,
    RuntimeMode,
    resolve_graph_plan,
)

__all__ = [
    "AttentionCaps",
    "CUDAGraphMode",
    "CompilationConfig",
    "DeviceCaps",
    "GraphPlan",
    "PlanChange",
    "RuntimeMode",
    "resolve_graph_plan",
]
