"""What the runner hands on about a laid-out step: which rows sample for which sequence, and
where each sequence's tokens sit in the flat batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.attention.backend import BatchLayout
from kiln.engine.sequence import Sequence
from kiln.runner.input_buffers import BatchRow


@dataclass
class StepInputs:
    layout: BatchLayout  # unpadded: the batch's own tokens
    query_lens: list[int]  # per request, in layout order
    sample_rows: torch.Tensor  # index of the last token of each sampling sequence
    sampling_seqs: list[Sequence]
    drafts: list[list[int]]  # per sampling sequence: the speculative tokens it verifies
    seq_starts: list[int]  # per sequence of the batch: the index of its first token
    # per sampling sequence: where a hybrid's verified run keeps its per-token states (-1: none)
    position_states: list[int]


def sample_rows_of(rows: list[BatchRow], owners: list[int], drafts: list[list[int]]):
    """Token indices whose logits are sampled, grouped by sequence in sampling order: a
    row's last token, or the last 1 + k of a row that verifies k drafts."""
    per_seq: list[list[int]] = [[] for _ in drafts]
    end = 0
    for row, owner in zip(rows, owners):
        end += len(row.token_ids)
        if owner >= 0:
            n = min(len(row.token_ids), 1 + len(drafts[owner]))
            per_seq[owner].extend(range(end - n, end))
    return [i for rows_of_seq in per_seq for i in rows_of_seq]


def seq_starts_of(query_lens: list[int], row_seqs: list[int], num_seqs: int) -> list[int]:
    """Each sequence's first token in the laid-out batch (its rows stay adjacent: the
    one-token rows keep their order ahead of the others)."""
    starts, end = [-1] * num_seqs, 0
    for n, index in zip(query_lens, row_seqs):
        if starts[index] < 0:
            starts[index] = end
        end += n
    return starts
