"""PIECEWISE graphs: one graph per compiled piece and capture size, the splitting ops (attention)
running eagerly between them. The split backend's pieces call `PiecewiseGraphs.call`, which
captures, replays or runs the piece as the runner's RuntimeState says."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.config.graph_plan import RuntimeMode
from kiln.cudagraphs.graph_backend import Captured, GraphBackend, strided_tensors, unowned


@dataclass
class RuntimeState:
    """Set by the runner around each forward: what the compiled pieces should do."""

    mode: RuntimeMode = RuntimeMode.NONE
    size: int = 0
    capturing: bool = False


@dataclass
class PiecewiseGraphs:
    """Per (piece, size) graphs. A piece's inputs are earlier pieces' outputs (in the pool, held
    unowned), persistent buffers, weights, KV caches and the attention outputs that an earlier
    piece allocated and the eager attention op filled: all at their captured addresses. An
    input that does not sit there (a splitting op that returns a fresh tensor) is copied there
    before the replay, and counted: kiln's attention ops write into their given output, so a
    step copies nothing."""

    backend: GraphBackend
    state: RuntimeState = field(default_factory=RuntimeState)
    graphs: dict[tuple[str, int], Captured] = field(default_factory=dict)
    sizes: set[int] = field(default_factory=set)
    copies: int = 0  # inputs copied to their captured address
    # data pointers of the captured outputs: the pool memory that inputs may alias
    pool_outputs: set[int] = field(default_factory=set)

    def call(self, name: str, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        st = self.state
        if st.mode is not RuntimeMode.PIECEWISE:
            return fn(*args)
        key = (name, st.size)
        if st.capturing and key not in self.graphs:
            return self._capture(key, fn, args)
        g = self.graphs[key]
        for static, arg in zip(g.inputs, args):
            if _moved(static, arg):
                static.copy_(arg)
                self.copies += 1
        g.replay()
        return g.outputs

    def _capture(self, key: tuple[str, int], fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        """Returns the owning outputs, which the rest of the capture's forward uses and then
        drops (back to the pool); the graph keeps unowned aliases. Inputs that are earlier
        graphs' outputs are kept unowned too; anything else (a fresh splitting-op output) is
        held, as the address a later replay copies to."""
        replay, out = self.backend.capture(lambda: fn(*args))
        inputs = tuple(unowned(a) if self._in_pool(a) else a for a in args)
        self.graphs[key] = Captured(replay, inputs, unowned(out))
        self.pool_outputs.update(t.data_ptr() for t in strided_tensors(out))
        return out

    def _in_pool(self, arg: Any) -> bool:
        return any(t.data_ptr() in self.pool_outputs for t in strided_tensors(arg))

    def has(self, size: int) -> bool:
        return size in self.sizes

    def clear(self) -> None:
        self.graphs.clear()
        self.sizes.clear()
        self.pool_outputs.clear()


def _moved(static: Any, arg: Any) -> bool:
    """Whether `arg` is a tensor that does not sit where the graph reads it. Weights are the
    same objects every call (and prepacked ones have no data pointer to compare)."""
    if arg is static or not isinstance(arg, torch.Tensor) or arg.layout is not torch.strided:
        return False
    return arg.data_ptr() != static.data_ptr()
