"""Graph memory at boot: measured before the KV cache is sized, and when the user fixed the KV
budget, the capture ladder cut to what fits (a warning that names the sizes dropped; an error
under --strict-graphs). The field report's 1..256 ladder OOM becomes a fit or a clear message."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kiln.compilation.plan import GraphPlan, PlanChange, with_capture_sizes
from kiln.errors import ConfigError

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


@dataclass
class CaptureStats:
    graphs: int = 0
    seconds: float = 0.0
    memory_bytes: int = 0  # measured across the real capture
    reserved_bytes: int = 0  # what was set aside before sizing the KV cache

    def to_dict(self) -> dict:
        return vars(self).copy()


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
