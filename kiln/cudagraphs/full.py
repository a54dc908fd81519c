"""FULL graphs: one graph of the whole forward per capture size."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.cudagraphs.graph_backend import Captured, GraphBackend, unowned


class FullGraphs:
    """One graph of the whole forward per capture size; its inputs are the runner's persistent
    buffers, so a replay only needs them filled (and padded)."""

    def __init__(self, backend: GraphBackend) -> None:
        self.backend = backend
        self.graphs: dict[int, Captured] = {}

    def capture(self, size: int, fn: Callable[[], torch.Tensor]) -> None:
        replay, out = self.backend.capture(fn)
        self.graphs[size] = Captured(replay, (), unowned(out))

    def has(self, size: int) -> bool:
        return size in self.graphs

    def run(self, size: int) -> torch.Tensor:
        g = self.graphs[size]
        g.replay()
        return g.outputs
