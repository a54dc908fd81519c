"""How a graph is captured and replayed. On a GPU, a CUDA graph in one memory pool shared by
every capture. The emulated backend (CPU tests) replays by re-running the callable on the same
tensors and copying the results into the captured outputs: the semantics a CUDA graph has
(same kernels, same addresses), so everything above it, from static buffers to padding and
dispatch, is exercised without a GPU.

Every graph's outputs live in the backend's one memory pool, and kiln keeps them only through
non-owning aliases (`unowned`): when a capture's forward ends, its tensors go back to the pool,
and the next capture (the next smaller size) reuses that memory. So the graphs of every size
share one pool as large as the largest size's, which is what boot measures before sizing the
KV cache; held strongly, each (piece, size) would keep its outputs, and the pool would grow with
the sum of the ladder (32x the largest size for vLLM's 67-size ladder). Sharing is safe
because one step replays one size's graphs, in capture order, and uses the output before the
next step replays anything."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

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


def strided_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in `value` that have memory to point at (not prepacked weights)."""
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in strided_tensors(v)]
    is_strided = isinstance(value, torch.Tensor) and value.layout is torch.strided
    return [value] if is_strided else []


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


@dataclass
class Captured:
    """A captured graph: how to replay it, what it reads, what it writes."""

    replay: Replay
    inputs: tuple[Any, ...]  # the tensors the graph reads (static addresses)
    outputs: Any


@dataclass
class CaptureStats:
    """What capturing a runner's graphs took, as the boot measured it."""

    graphs: int = 0
    seconds: float = 0.0
    memory_bytes: int = 0  # measured across the real capture
    reserved_bytes: int = 0  # what was set aside before sizing the KV cache
    measured: bool = False  # whether the ladder was measured on a provisional KV cache

    def to_dict(self) -> dict:
        return vars(self).copy()
