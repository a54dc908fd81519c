"""A hybrid model's Gated DeltaNet states, as its runner holds them: per layer, one (convolution,
recurrent) state per sequence slot, then the rows where verified speculative runs keep their
state after each token, and the prefix cache's checkpoints of them."""

from __future__ import annotations

import torch

from kiln.engine.sequence import Sequence
from kiln.layers.gated_deltanet import GatedDeltaNet


class StatePool:
    def __init__(
        self, layers: list[GatedDeltaNet], device: torch.device, num_checkpoints: int,
        position_rows: tuple[int, int, int] = (0, 0, 0),
    ) -> None:  # fmt: skip
        """`num_checkpoints`: the prefix cache's state checkpoints (state_checkpoints.py);
        `position_rows`, with speculative decoding: a verified run of 1 + k tokens keeps its
        state after each of its first k in rows after the slots, so that a rejection takes the
        state at the last kept token back: (the first such row, how many sequences may verify
        in a step, k)."""
        self.layers, self.device, self.num_checkpoints = layers, device, num_checkpoints
        self.position_start, self.position_seqs, self.per_position_run = position_rows
        self.verified_runs: dict[int, tuple[int, int]] = {}  # seq id -> (first row, kept)
        # per layer: (conv, recurrent) of the slots, then of the checkpoints
        self.tensors: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    @property
    def position_rows(self) -> int:
        return self.position_seqs * self.per_position_run

    def trace_key(self) -> dict:
        """What a compiled trace specializes on: the pools are inputs of fixed size."""
        return {"state_checkpoints": self.num_checkpoints,
                "position_states": [self.position_start, self.position_seqs,
                                    self.per_position_run]}  # fmt: skip

    def allocate(self, num_slots: int, dtype: torch.dtype) -> None:
        """One slot per sequence the scheduler may run (`num_slots` without speculation), the
        per-token rows, then the checkpoints; the convolution's inputs in the model's dtype, the
        delta rule's matrices in float32 (a slot is zeroed when a sequence starts in it, a
        checkpoint written before it is read: empty is enough)."""
        if self.position_rows:
            num_slots = self.position_start + self.position_rows
        self.tensors = []
        for layer in self.layers:
            states = [self._tensors(layer, n, dtype) for n in (num_slots, self.num_checkpoints)]
            layer.bind_states(*states[0], *states[1])
            self.tensors.append(states)

    def _tensors(self, layer: GatedDeltaNet, count: int, dtype: torch.dtype):
        conv = torch.empty(count, layer.conv_dim, layer.conv1d.weight.shape[-1] - 1,
                           dtype=dtype, device=self.device)  # fmt: skip
        recurrent = torch.empty(count, layer.value_heads, layer.key_dim, layer.value_dim,
                                dtype=torch.float32, device=self.device)  # fmt: skip
        return conv, recurrent

    def restore(self, entry: int, slot: int) -> None:
        """A prefix hit: the state saved in checkpoint `entry` into `slot`."""
        for (conv, recurrent), (saved_conv, saved_recurrent) in self.tensors:
            conv[slot].copy_(saved_conv[entry])
            recurrent[slot].copy_(saved_recurrent[entry])

    def copy_slot(self, source: int, target: int) -> None:
        for (conv, recurrent), _ in self.tensors:
            conv[target].copy_(conv[source])
            recurrent[target].copy_(recurrent[source])

    def position_row(self, taken: list[int]) -> int:
        """A verifying sequence: the first of the rows its run keeps its per-token states in
        (the next free k of them), given the rows already `taken` this step (-1: none)."""
        used = sum(1 for at in taken if at >= 0)
        if used >= self.position_seqs:
            raise RuntimeError(
                f"{used + 1} sequences verify drafts in one step, but the state pool holds "
                f"{self.position_seqs}: the speculator's batch-size limit was not applied"
            )
        return self.position_start + used * self.per_position_run

    def keep_verified(
        self, seqs: list[Sequence], kept: list[int], rejected: list[int], first_rows: list[int]
    ) -> None:
        """After verification: each sequence's run (its first per-token row and its `kept`
        tokens) remembered for `save_verified`, and where drafts were rejected, the state after
        the last kept token copied into its slot (the slot's went past it)."""
        self.verified_runs = {}
        for seq, n, lost, first in zip(seqs, kept, rejected, first_rows):
            self.verified_runs[seq.seq_id] = (first, n)
            if lost:
                self.copy_slot(first + n - 1, seq.state_slot)

    def save_verified(self, seq: Sequence, num_tokens: int, entry: int) -> None:
        """The state after `num_tokens` of the sequence's last verified run, into prefix-cache
        checkpoint `entry` (the slot holds the state after the kept ones, the rows the rest)."""
        first_row, kept = self.verified_runs[seq.seq_id]
        source = seq.state_slot if num_tokens == kept else first_row + num_tokens - 1
        for (conv, recurrent), (saved_conv, saved_recurrent) in self.tensors:
            saved_conv[entry].copy_(conv[source])
            saved_recurrent[entry].copy_(recurrent[source])
