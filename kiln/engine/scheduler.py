"""Continuous batching with chunked prefill and preemption by recompute.

Every step gets a token budget. Running sequences go first, oldest first: a decode takes one
token (and its speculative drafts, those that fit), an unfinished prefill takes the next
chunk. Waiting sequences are admitted with what remains. When the KV cache runs out, the
newest running sequence is preempted: its blocks are released and it waits at the front of
the queue to be recomputed (its full blocks usually come back as prefix-cache hits)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kiln.config.engine import SchedulerConfig
from kiln.engine.block_manager import BlockManager
from kiln.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens each sequence computes now

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        preempted = self._schedule_running(batch, budget)
        # under KV pressure no drafts: the blocks are the sequences' own tokens'
        self._add_drafts(batch, 0 if preempted else budget - batch.total_tokens)
        if not preempted:
            self._admit_waiting(batch, budget - batch.total_tokens)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> bool:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.blocks.can_append(seq, n):
                preempted = True
                self._preempt(self.running.pop())
                if seq.status is not SequenceStatus.RUNNING:
                    return True
            self.blocks.append(seq, n)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
            i += 1
        return preempted

    def _add_drafts(self, batch: ScheduledBatch, budget: int) -> None:
        """Speculative drafts, after every running sequence got its own tokens: from the budget
        and the free blocks left, so drafts never cost another sequence its step or its KV.
        The drafts that do not fit are dropped."""
        for i, seq in enumerate(batch.seqs):
            n, extra = batch.num_tokens[i], min(len(seq.spec_token_ids), budget)
            if n != seq.num_uncomputed_tokens:
                extra = 0  # a prefill chunk, never with drafts
            while extra and not self.blocks.can_append(seq, n + extra):
                extra -= 1
            del seq.spec_token_ids[extra:]
            if extra:
                self.blocks.append(seq, n + extra)
                batch.num_tokens[i] += extra
                budget -= extra

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self.blocks.find_cached_prefix(seq)
            cached = len(hits) * self.blocks.block_size
            n = min(seq.num_tokens - cached, budget)
            if not self.blocks.can_admit(hits, cached + n):
                break
            self.waiting.popleft()
            self.blocks.admit(seq, hits, cached + n)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = cached
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.blocks.release(seq)
        seq.spec_token_ids = []
        seq.status = SequenceStatus.FINISHED
