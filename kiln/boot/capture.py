"""CUDA graphs at boot, beside the KV cache. Every graph of the plan is captured and measured
on a provisional KV cache before the real one is sized; with a fixed KV budget the capture
ladder is cut to the memory left (a warning naming the sizes dropped; an error under
--strict-graphs), so a ladder too large for the budget is a fit or a clear message, never an
out-of-memory at KV allocation. Then the graphs are captured again on the real cache (they
read its addresses), largest first, all in the graph backend's one pool."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kiln.config.graph_plan import GraphPlan, PlanChange, RuntimeMode, with_capture_sizes
from kiln.cudagraphs.graph_backend import CaptureStats, CudaGraphBackend, GraphBackend
from kiln.cudagraphs.piecewise import RuntimeState
from kiln.errors import ConfigError
from kiln.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

GiB = 2**30


@dataclass(frozen=True)
class GraphMemoryEstimate:
    """Memory measured capturing the whole ladder. The pool all graphs share is sized by the
    largest size's activations, and the graphs' own cost grows with how many sizes there are,
    so a ladder cut at a smaller largest size scales it down roughly in proportion."""

    measured_bytes: int
    largest_size: int

    def for_largest(self, size: int) -> int:
        if self.largest_size <= 0:
            return 0
        return -(-self.measured_bytes * size // self.largest_size)


def graph_backend_for(
    plan: GraphPlan, device: torch.device, given: GraphBackend | None
) -> GraphBackend | None:
    """None when the plan captures nothing; else the given backend or real CUDA graphs."""
    if plan.decode_mode is RuntimeMode.NONE and plan.mixed_mode is RuntimeMode.NONE:
        return None
    return given or CudaGraphBackend(device)


def fit_ladder(
    plan: GraphPlan, estimate: GraphMemoryEstimate, available: int, strict: bool
) -> GraphPlan:
    """Drop the capture sizes whose graphs would not fit in `available` bytes."""
    sizes = sorted(set(plan.decode_capture_sizes) | set(plan.mixed_capture_sizes))
    if not sizes or estimate.for_largest(sizes[-1]) <= available:
        return plan
    keep = {s for s in sizes if estimate.for_largest(s) <= available}
    dropped = [s for s in sizes if s not in keep]
    change = PlanChange(
        "capture sizes",
        _show(sizes),
        _show(sorted(keep)),
        f"graphs up to size {sizes[-1]} need about {estimate.for_largest(sizes[-1]) / GiB:.2f} "
        f"GiB but {available / GiB:.2f} GiB is left beside the fixed KV cache; dropped sizes "
        f"{dropped} (those batches run without a graph)",
        "lower --kv-cache-memory, or set max_cudagraph_capture_size in --compilation-config",
    )
    if strict:
        raise ConfigError(f"--strict-graphs: {change.message()}")
    logger.warning("graph plan: %s", change.message())
    decode = tuple(s for s in plan.decode_capture_sizes if s in keep)
    mixed = tuple(s for s in plan.mixed_capture_sizes if s in keep)
    return with_capture_sizes(plan, decode, mixed, change)


def _show(sizes: list[int]) -> str:
    return "[" + ", ".join(map(str, sizes)) + "]" if sizes else "(none)"


class GraphCapture:
    """Measures, fits and captures the runner's graphs at boot."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.backend = runner, runner.graph_backend
        self.stats = CaptureStats()
        self.estimate: GraphMemoryEstimate | None = None

    def measure(self, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> int:
        """Capture every graph of the plan on a provisional two-block KV cache (capture batches
        are all padding: they read and write no KV), measure the memory they take and release
        it; the KV cache is then sized beside it. The whole ladder, not its largest size
        extrapolated: the sizes share one pool, so memory does not scale with their number,
        and what each graph costs on its own is the device's to say (vLLM's two-sample
        extrapolation overestimated 3x on some models and underestimated on others)."""
        gb = self.backend
        if gb is None or not gb.measures_memory:
            return 0
        self.runner.allocate_kv_cache(2, dtype, kv_dtype)
        self._warm_up()
        before = self._memory_after_release()
        self.capture_all()
        with_graphs = gb.memory_in_use()
        self.runner.drop_graphs()
        left = self._memory_after_release()
        # what the first captures left behind (kernels loaded for sizes the warm-up did not
        # run, their workspaces) stays outside the free memory KV sizing reads and is not paid
        # again at the real capture: counted in, it overstated an H200's graphs by 60%
        measured = max(0, with_graphs - max(before, left))
        self.runner.kv_caches = []
        gb.release()
        plan = self.runner.plan
        sizes = plan.decode_capture_sizes + plan.mixed_capture_sizes
        self.estimate = GraphMemoryEstimate(measured, max(sizes, default=0))
        self.stats.reserved_bytes, self.stats.measured = measured, True
        logger.info(
            "graph memory measured before KV sizing: %.2f GiB (%.2f GiB more stays loaded)",
            measured / GiB,
            max(0, left - before) / GiB,
        )
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
        self._warm_up()
        before = self._memory_after_release()
        self.stats.graphs = self.capture_all()
        self.stats.memory_bytes = max(0, gb.memory_in_use() - before)
        self.stats.seconds = time.monotonic() - t0
        self.runner.graphs_captured = True
        self.runner.reset_counters()
        logger.info(
            "captured %d graphs in %.1f s, using %.2f GiB (%.2f GiB reserved before KV sizing)",
            self.stats.graphs,
            self.stats.seconds,
            self.stats.memory_bytes / GiB,
            self.stats.reserved_bytes / GiB,
        )

    def sizes(self, mode: RuntimeMode) -> list[int]:
        """Sizes to capture for a runtime mode, largest first."""
        p = self.runner.plan
        sizes = set()
        if p.decode_mode is mode:
            sizes |= set(p.decode_capture_sizes)
        if p.mixed_mode is mode:
            sizes |= set(p.mixed_capture_sizes)
        return sorted(sizes, reverse=True)

    def _memory_after_release(self) -> int:
        """Device memory in use with the allocator's cache returned: `torch.cuda.graph` empties
        that cache as each capture starts, so a reading taken over the warm-up's cached
        temporaries dropped by their size across the captures (seen on an H200: 0 measured
        before KV sizing against 32 MiB at capture)."""
        self.backend.release()
        return self.backend.memory_in_use()

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One uncaptured forward at the largest capture size, as the captures run it: compiles
        (mode 3), loads kernels and allocates the capture stream's workspaces, so that graph
        memory read across the captures is the graphs' own."""
        sizes = self.sizes(RuntimeMode.PIECEWISE) + self.sizes(RuntimeMode.FULL)
        if sizes:
            self.backend.warm_up(self.runner.padded_forward(max(sizes)))

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Every graph of the plan, largest size first (PIECEWISE, then FULL), all in the graph
        backend's one pool. Returns how many graphs were captured."""
        count = 0
        if self.runner.piecewise is not None:
            for size in self.sizes(RuntimeMode.PIECEWISE):
                count += self.capture_size(RuntimeMode.PIECEWISE, size)
        if self.runner.full is not None:
            for size in self.sizes(RuntimeMode.FULL):
                count += self.capture_size(RuntimeMode.FULL, size)
        return count

    @torch.inference_mode()
    def capture_size(self, mode: RuntimeMode, size: int) -> int:
        """The graphs of one runtime mode at one size; returns how many were captured."""
        run = self.runner.padded_forward(size)
        self.backend.warm_up(run)  # this size's first call (autotuning, workspaces)
        if mode is RuntimeMode.FULL:
            self.runner.full.capture(size, run)
            return 1
        piecewise = self.runner.piecewise
        before = len(piecewise.graphs)
        piecewise.state = RuntimeState(RuntimeMode.PIECEWISE, size, capturing=True)
        try:
            run()
        finally:
            piecewise.state = RuntimeState()
        piecewise.sizes.add(size)
        return len(piecewise.graphs) - before
