"""The graph plan as the short table printed at boot and by `kiln info`, and its logging."""

from __future__ import annotations

import logging
from typing import Any

from kiln.config.graph_plan import GraphPlan, show
from kiln.config.inductor_options import shown_options


def plan_table(plan: GraphPlan) -> str:
    """Requested, resolved and why, one row per setting, then every change."""
    req = plan.requested
    rows = [
        ("compilation mode", show(req.mode), str(plan.mode)),
        ("cudagraph_mode", show(req.cudagraph_mode), plan.cudagraph_mode.value),
        ("decode / mixed", "", f"{plan.decode_mode.value} / {plan.mixed_mode.value}"),
        ("decode capture sizes", "", _sizes(plan.decode_capture_sizes)),
        ("mixed capture sizes", "", _sizes(plan.mixed_capture_sizes)),
        ("splitting ops", _ops(req.splitting_ops), _splits(plan)),
        ("piece backend", show(req.backend), plan.backend or "(not compiled)"),
    ]
    if req.inductor_compile_config or plan.inductor_options:
        resolved = _options(plan.inductor_options) if plan.inductor_options else "(unused)"
        rows.append(("inductor options", "", resolved))
    lines = [f"{'graph plan':<22} {'requested':<20} resolved"]
    lines += [f"{a:<22} {b:<20} {c}" for a, b, c in rows]
    lines += [f"  changed: {c.message()}" for c in plan.changes]
    return "\n".join(lines)


def log_plan(plan: GraphPlan, log: logging.Logger) -> None:
    """One WARNING per change (each names its remedy), then the table at INFO."""
    for change in plan.changes:
        log.warning("graph plan: %s", change.message())
    log.info("graph plan:\n%s", plan_table(plan))


def _splits(plan: GraphPlan) -> str:
    if plan.mode != 3:
        return "(not compiled)"
    one = "one Inductor graph" if plan.backend == "inductor" else "one graph"
    return ", ".join(plan.splitting_ops) or f"(none: {one})"


def _ops(ops: tuple[str, ...] | None) -> str:
    return "(default)" if ops is None else ", ".join(ops) or "[]"


def _options(options: tuple[tuple[str, Any], ...]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in shown_options(options).items())


def _sizes(sizes: tuple[int, ...]) -> str:
    if not sizes:
        return "(none)"
    if len(sizes) <= 8:
        return ", ".join(map(str, sizes))
    return f"{', '.join(map(str, sizes[:4]))}, ..., {sizes[-1]} ({len(sizes)} sizes)"
