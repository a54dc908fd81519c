"""Graph capture and replay: FULL graphs (one per capture size, the whole forward) and
PIECEWISE graphs (one per compiled piece and capture size, splitting ops eager in between).

Every graph's outputs live in the backend's one memory pool, and kiln keeps them only through
non-owning aliases (`unowned`): when a capture's forward ends, its tensors go back to the pool,
and the next capture (the next smaller size) reuses that memory. So the graphs of every size
share one pool as large as the largest size's, which is what boot measures before sizing the
KV cache; held strongly, each (piece, size) would keep its outputs, and the pool would grow with
the sum of the ladder (32x the largest size for vLLM's 67-size ladder). Sharing is safe
because one step replays one size's graphs, in capture order, and uses the output before the
next step replays anything.

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
        """Capture fn(); return (replay, fn's outputs, which every replay rewrites). The memory
        of the outputs must stay valid for replays after the caller drops them: a CUDA graph's
        pool keeps it, the emulator keeps the tensors."""

    def warm_up(self, fn: Callable[[], Any]) -> Any:
        """Run fn() as captures will, but uncaptured: on a GPU on the capture stream, so that
        what a first call allocates (compiled kernels, the stream's cuBLAS workspace) exists
        before graph memory is read, not inside the first capture."""
        return fn()

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

    def warm_up(self, fn: Callable[[], Any]) -> Any:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = fn()
        current.wait_stream(self.stream)
        return out

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
    tensors hold now and writes into the captured output tensors (which its replay keeps alive,
    as a CUDA graph's pool keeps their memory; it does not share memory between captures)."""

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


def unowned(value: Any) -> Any:
    """`value` with every tensor replaced by an alias of its memory that does not keep the
    memory allocated (what vLLM's weak_ref_tensors does, built from torch's non-owning storage
    constructor, which Inductor's CUDA graph trees use the same way)."""
    if isinstance(value, (tuple, list)):
        return type(value)(unowned(v) for v in value)
    if not isinstance(value, torch.Tensor) or value.layout is not torch.strided:
        return value
    storage = value.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), value.device, storage.nbytes()
    )
    empty = torch.empty(0, dtype=value.dtype, device=value.device)
    return empty.set_(alias, value.storage_offset(), value.shape, value.stride())


def _strided(value: Any) -> list[torch.Tensor]:
    """The tensors in `value` that have memory to point at (not prepacked weights)."""
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _strided(v)]
    is_strided = isinstance(value, torch.Tensor) and value.layout is torch.strided
    return [value] if is_strided else []


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
        self.graphs[size] = _Captured(replay, (), unowned(out))

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
    """Per (piece, size) graphs. A piece's inputs are earlier pieces' outputs (in the pool, held
    unowned), persistent buffers, weights, KV caches and the attention outputs that an earlier
    piece allocated and the eager attention op filled: all at their captured addresses. An
    input that does not sit there (a splitting op that returns a fresh tensor) is copied there
    before the replay, and counted: kiln's attention ops write into their given output, so a
    step copies nothing."""

    backend: GraphBackend
    state: RuntimeState = field(default_factory=RuntimeState)
    graphs: dict[tuple[str, int], _Captured] = field(default_factory=dict)
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
        self.graphs[key] = _Captured(replay, inputs, unowned(out))
        self.pool_outputs.update(t.data_ptr() for t in _strided(out))
        return out

    def _in_pool(self, arg: Any) -> bool:
        return any(t.data_ptr() in self.pool_outputs for t in _strided(arg))

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
