"""What the engine loop needs from a model runner: a scheduled batch in, the tokens sampled for
it out. kiln.runner's ModelRunner implements it; the loop imports no runner, and kiln.boot
hands it one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kiln.config.graph_plan import GraphPlan
from kiln.engine.scheduler import ScheduledBatch
from kiln.engine.sequence import Sequence


@dataclass
class SampledTokens:
    """The new tokens of each sequence that reached the end of its known tokens this step (a
    prefill chunk that does not finish its prompt samples nothing): one, or with speculative
    decoding its accepted drafts and one token of the target's after them."""

    seqs: list[Sequence]
    token_ids: list[list[int]]
    logprobs: torch.Tensor | None  # [rows, V] raw log-softmax, when any row asked for it
    first_rows: list[int] | None = None  # each sequence's first row of logprobs (None: its index)
    num_drafts: list[int] | None = None  # drafts each sequence verified (None: no speculation)

    def logprob_row(self, i: int, j: int) -> torch.Tensor | None:
        """The log-softmax row of sequence i's token j."""
        if self.logprobs is None:
            return None
        return self.logprobs[(self.first_rows[i] if self.first_rows else i) + j]

    def num_rejected(self, i: int) -> int:
        return self.num_drafts[i] + 1 - len(self.token_ids[i]) if self.num_drafts else 0


class ModelExecutor(Protocol):
    plan: GraphPlan  # the graph plan it executes

    def execute(self, batch: ScheduledBatch) -> SampledTokens: ...

    def graph_stats(self) -> dict[str, Any]:
        """Steps per runtime mode, graph misses, recompilations (for stats() and /metrics)."""
        ...

    def compile_stats(self) -> dict[str, Any] | None:
        """What mode 3 compiled and how long it took; None in mode 0."""
        ...

    def reset_counters(self) -> None:
        """Forget the steps counted so far (warm-up and capture are not the workload's)."""
        ...

    def release_memory(self) -> None:
        """Free the KV cache and the captured graphs now."""
        ...
