"""Per step: the batch descriptor, the runtime mode the plan gives it, and the counters that
make every step's mode (and every graph miss) visible."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from kiln.config.graph_plan import GraphPlan, RuntimeMode


@dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int  # padded to a capture size when a graph runs
    num_reqs: int
    uniform_token_count: int | None  # tokens per request when every request has the same


def describe(query_lens: list[int]) -> BatchDescriptor:
    uniform = query_lens[0] if len(set(query_lens)) == 1 else None
    return BatchDescriptor(sum(query_lens), len(query_lens), uniform)


def _pad(sizes: tuple[int, ...], n: int) -> int | None:
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass
class Dispatch:
    mode: RuntimeMode
    descriptor: BatchDescriptor  # num_tokens padded for the chosen graph
    promised: bool  # whether the plan has a graph for this batch


def dispatch(plan: GraphPlan, batch: BatchDescriptor) -> Dispatch:
    """FULL for uniform decode batches with a FULL graph; the mixed mode for the rest, where a
    capture size fits; NONE otherwise (a batch above the ladder runs eagerly by design)."""
    uniform = batch.uniform_token_count
    decode = uniform == plan.uniform_decode_query_len or (
        uniform == 1 and plan.single_token_decodes
    )
    candidates = []
    if decode and plan.decode_mode is not RuntimeMode.NONE:
        candidates.append((plan.decode_mode, plan.decode_capture_sizes))
    if plan.mixed_mode is not RuntimeMode.NONE:
        candidates.append((plan.mixed_mode, plan.mixed_capture_sizes))
    for mode, sizes in candidates:
        padded = _pad(sizes, batch.num_tokens)
        if padded is not None:
            desc = BatchDescriptor(padded, batch.num_reqs, batch.uniform_token_count)
            return Dispatch(mode, desc, promised=True)
    return Dispatch(RuntimeMode.NONE, batch, promised=False)


@dataclass
class GraphCounters:
    steps: Counter = field(default_factory=Counter)  # runtime mode -> steps
    misses: int = 0  # steps that ran eagerly though the plan promised a graph
    miss_examples: list[str] = field(default_factory=list)

    def record(self, mode: RuntimeMode) -> None:
        self.steps[mode.value] += 1

    def record_miss(self, wanted: Dispatch) -> None:
        self.misses += 1
        if len(self.miss_examples) < 8:
            d = wanted.descriptor
            self.miss_examples.append(
                f"{wanted.mode.value} num_tokens={d.num_tokens} num_reqs={d.num_reqs} "
                f"uniform_token_count={d.uniform_token_count}"
            )

    def to_dict(self) -> dict:
        return {
            "steps": {m.value: self.steps.get(m.value, 0) for m in RuntimeMode},
            "graph_misses": self.misses,
            "graph_miss_examples": list(self.miss_examples),
        }
