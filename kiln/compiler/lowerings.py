"""Inductor lowerings for kiln's own ops, where the default (a call back into the op's Python
implementation) costs more than the op's kernel is worth.

`kiln::onednn_linear` is opaque to Inductor on purpose: Inductor's lowering of the oneDNN
linear it wraps wants frozen weights and would pick its own kernels. Left as a custom op,
every call in a compiled piece would go from the generated code through the dispatcher into
Python and back (a reshape, the oneDNN call, a view), which costs about a quarter of a small
linear's time (docs/performance.md). Lowered to a fallback kernel of `mkldnn::_linear_pointwise`
itself, the generated code calls the oneDNN op directly, on the weights as they are (graph
inputs, not constants)."""

from __future__ import annotations

import torch

import kiln.layers.linear  # noqa: F401  (defines kiln::onednn_linear)


def register_inductor_lowerings() -> None:
    """Idempotent; called before Inductor compiles a piece. Inductor keeps its lowerings in
    one table per process, keyed by op: this sets the entry of kiln's op, nothing else. An
    entry already there is Inductor's default fallback if the op was compiled before (by a
    torch.compile outside kiln's backend, say): it is replaced."""
    from torch._inductor import lowering

    op = torch.ops.kiln.onednn_linear.default
    registered = lowering.lowerings.get(op)
    if getattr(registered, "kiln_lowering", False) or not torch.backends.mkldnn.is_available():
        return
    target = torch.ops.mkldnn._linear_pointwise.default
    fallback = lowering.fallback_handler(target, add_to_fallback_set=False)

    def onednn_linear(x, packed, bias=None):  # Inductor IR nodes in, one out
        return fallback(x, packed, bias, "none", [], "")

    onednn_linear.kiln_lowering = True  # type: ignore[attr-defined]  (kept by functools.wraps)
    lowering.register_lowering(op, type_promotion_kind=None)(onednn_linear)
