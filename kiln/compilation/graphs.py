"""Graph capture and replay: FULL graphs (one per capture size, the whole forward) and
PIECEWISE graphs (one per compiled piece and capture size, splitting ops eager in between).

A `GraphBackend` captures a callable and returns how to replay it. On a GPU that is a CUDA
graph in one memory pool shared by every capture. The emulated backend (CPU tests) replays by
re-running the callable on the same tensors and copying the results into the captured outputs:
the semantics a CUDA graph has (same kernels, same addresses), so everything above it, from
static buffers to padding and dispatch, is exercised without a GPU."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.compilation.plan import RuntimeMode

logger = logging.getLogger(__name__)

Replay = Callable[[], None]


class GraphBackend(ABC):
    # whether boot measures the largest graphs on a provisional KV cache before sizing the
    # real one (the GPU's boot sequence)
    measures_memory = True

    @abstractmethod
    def capture(self, fn: Callable[[], Any]) -> tuple[Replay, Any]:
        """Capture fn(); return (replay, fn's outputs, which every replay rewrites)."""

    def memory_in_use(self) -> int:
        """Device bytes in use now (graph memory is the difference across captures)."""
        return 0

    def release(self) -> None:
        """Return cached, unused pool memory to the device (nothing to return off the GPU)."""
        return None


class CudaGraphBackend(GraphBackend):
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def capture(self, fn: Callable[[], Any]) -> tuple[Replay, Any]:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        torch.cuda.synchronize(self.device)
        return graph.replay, out

    def memory_in_use(self) -> int:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def release(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


class EmulatedGraphBackend(GraphBackend):
    """CPU stand-in with a CUDA graph's semantics: replay reads whatever the captured input
    tensors hold now and writes into the captured output tensors."""

    def __init__(self, measures_memory: bool = False) -> None:
        """`measures_memory`: run the GPU's boot sequence (capture on a provisional KV cache,
        drop, capture again on the real one); off by default, as it measures nothing here."""
        self.captures = 0
        self.replays = 0
        self.measures_memory = measures_memory

    def capture(self, fn: Callable[[], Any]) -> tuple[Replay, Any]:
        self.captures += 1
        out = fn()

        def replay() -> None:
            self.replays += 1
            _copy_into(out, fn())

        return replay, out


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


@dataclass
class _Captured:
    replay: Replay
    inputs: tuple[Any, ...]  # the tensors the graph reads (static addresses)
    outputs: Any


class FullGraphs:
    """One graph of the whole forward per capture size; its inputs are the runner's persistent
    buffers, so a replay only needs them filled (and padded)."""

    def __init__(self, backend: GraphBackend) -> None:
        self.backend = backend
        self.graphs: dict[int, _Captured] = {}

    def capture(self, size: int, fn: Callable[[], torch.Tensor]) -> None:
        replay, out = self.backend.capture(fn)
        self.graphs[size] = _Captured(replay, (), out)

    def has(self, size: int) -> bool:
        return size in self.graphs

    def run(self, size: int) -> torch.Tensor:
        g = self.graphs[size]
        g.replay()
        return g.outputs


@dataclass
class RuntimeState:
    """Set by the runner around each forward: what the compiled pieces should do."""

    mode: RuntimeMode = RuntimeMode.NONE
    size: int = 0
    capturing: bool = False


@dataclass
class PiecewiseGraphs:
    """Per (piece, size) graphs. A piece's inputs are the previous piece's static outputs,
    persistent buffers, weights, or a splitting op's fresh output: whatever does not sit at the
    captured address is copied there before the replay."""

    backend: GraphBackend
    state: RuntimeState = field(default_factory=RuntimeState)
    graphs: dict[tuple[str, int], _Captured] = field(default_factory=dict)
    sizes: set[int] = field(default_factory=set)
    copies: int = 0  # inputs copied to their captured address (splitting-op outputs)

    def call(self, name: str, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        st = self.state
        if st.mode is not RuntimeMode.PIECEWISE:
            return fn(*args)
        key = (name, st.size)
        if st.capturing and key not in self.graphs:
            replay, out = self.backend.capture(lambda: fn(*args))
            self.graphs[key] = _Captured(replay, tuple(args), out)
            return out
        g = self.graphs[key]
        for static, arg in zip(g.inputs, args):
            if _moved(static, arg):
                static.copy_(arg)
                self.copies += 1
        g.replay()
        return g.outputs

    def has(self, size: int) -> bool:
        return size in self.sizes


def _moved(static: Any, arg: Any) -> bool:
    """Whether `arg` is a tensor that does not sit where the graph reads it. Weights are the
    same objects every call (and prepacked ones have no data pointer to compare)."""
    if arg is static or not isinstance(arg, torch.Tensor) or arg.layout is not torch.strided:
        return False
    return arg.data_ptr() != static.data_ptr()
