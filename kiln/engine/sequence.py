"""One sequence being generated: a request with n > 1 has n of them."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.outputs import Logprobs, RequestMetrics
from kiln.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    generator: torch.Generator | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks already registered in the prefix cache
    state_slot: int = -1  # hybrid models: the slot of its per-layer state while admitted
    # hybrid prefix caching (state_checkpoints.py): the checkpoint to fill the slot from before
    # the next step, and the one this step writes, after `checkpoint_at` of its tokens
    restore_entry: int = -1
    checkpoint_at: int = -1
    checkpoint_entry: int = -1
    block_hashes: list[int] = field(default_factory=list)
    # speculative decoding: tokens proposed after token_ids, verified in the next step; a
    # draft model's distributions they were drawn from ([k, V], sampled requests only); and
    # how many of its tokens the draft model's KV cache holds
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None
    draft_computed: int = 0
    # an MTP head's output at the last computed position (with how many tokens were computed
    # then): the first draft's logits come from it
    mtp_hidden: tuple[int, torch.Tensor] | None = None
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    logprobs: list[Logprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_reported_tokens: int = 0  # output tokens already handed out in a RequestOutput

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


class SequenceCounter:
    """Hands out sequence ids; one per engine, so no module-level state."""

    def __init__(self) -> None:
        self._ids = itertools.count()

    def next(self) -> int:
        return next(self._ids)
