"""CUDA graphs at boot, beside the KV cache: every graph of the plan is captured and measured
on a provisional KV cache before the real one is sized; with a fixed KV budget the capture
ladder is cut to the memory left; then the graphs are captured again on the real cache (they
read its addresses), largest first."""

from __future__ import annotations

import logging
import time

import torch

from kiln.compilation.capture import CaptureStats, GraphMemoryEstimate, fit_ladder
from kiln.compilation.graphs import CudaGraphBackend, GraphBackend
from kiln.compilation.plan import DeviceCaps, GraphPlan, RuntimeMode
from kiln.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def device_caps(device: torch.device, graph_backend: GraphBackend | None = None) -> DeviceCaps:
    """CUDA devices capture graphs; so does any device given a graph backend (the CPU tests'
    emulator)."""
    if device.type == "cuda" or graph_backend is not None:
        return DeviceCaps(device.type, True)
    return DeviceCaps.cpu()


def graph_backend_for(
    plan: GraphPlan, device: torch.device, given: GraphBackend | None
) -> GraphBackend | None:
    """None when the plan captures nothing; else the given backend or real CUDA graphs."""
    if plan.decode_mode is RuntimeMode.NONE and plan.mixed_mode is RuntimeMode.NONE:
        return None
    return given or CudaGraphBackend(device)


class GraphBoot:
    def __init__(self, runner: ModelRunner, backend: GraphBackend | None) -> None:
        self.runner, self.backend = runner, backend
        self.stats = CaptureStats()
        self.estimate: GraphMemoryEstimate | None = None

    def measure(self, dtype: torch.dtype) -> int:
        """Capture every graph of the plan on a provisional two-block KV cache (capture batches
        are all padding: they read and write no KV), measure the memory they take and release
        it; the KV cache is then sized beside it. The whole ladder, not its largest size
        extrapolated: the sizes share one pool, so memory does not scale with their number,
        and what each graph costs on its own is the device's to say (vLLM's two-sample
        extrapolation overestimated 3x on some models and underestimated on others)."""
        gb = self.backend
        if gb is None or not gb.measures_memory:
            return 0
        self.runner.allocate_kv_cache(2, dtype)
        self.runner.warm_up_graphs()
        before = gb.memory_in_use()
        self.runner.capture_graphs()
        measured = max(0, gb.memory_in_use() - before)
        self.runner.drop_graphs()
        self.runner.kv_caches = []
        gb.release()
        plan = self.runner.plan
        sizes = plan.decode_capture_sizes + plan.mixed_capture_sizes
        self.estimate = GraphMemoryEstimate(measured, max(sizes, default=0))
        self.stats.reserved_bytes = measured
        logger.info("graph memory measured before KV sizing: %.2f GiB", measured / 2**30)
        return measured

    def fit_beside_fixed_kv(self, free_bytes: int, strict: bool) -> GraphPlan:
        """With the KV budget fixed by the user: the plan with the ladder cut to what fits."""
        if self.estimate is not None and self.stats.reserved_bytes:
            self.runner.plan = fit_ladder(self.runner.plan, self.estimate, free_bytes, strict)
        return self.runner.plan

    def capture(self) -> None:
        gb = self.backend
        if gb is None:
            return
        t0 = time.monotonic()
        self.runner.warm_up_graphs()
        before = gb.memory_in_use()
        self.stats.graphs = self.runner.capture_graphs()
        self.stats.memory_bytes = max(0, gb.memory_in_use() - before)
        self.stats.seconds = time.monotonic() - t0
        self.runner.counters = type(self.runner.counters)()
        logger.info(
            "captured %d graphs in %.1f s, using %.2f GiB (%.2f GiB reserved before KV sizing)",
            self.stats.graphs,
            self.stats.seconds,
            self.stats.memory_bytes / 2**30,
            self.stats.reserved_bytes / 2**30,
        )
