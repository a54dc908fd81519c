"""The model runner's persistent input buffers. Each is its own contiguous tensor, sized for the
largest step; a step writes into the head of each and hands out views of that head, which are
contiguous too (block tables are stored flat so that a [B, W] view of the head is). A captured
graph reads them at their fixed addresses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.attention.backend import BatchLayout, StateBuffers


@dataclass(frozen=True)
class BatchRow:
    """One request's part of a step: the tokens it computes now, from `first_position` on (the
    ones before are in the KV cache), and its block table."""

    token_ids: list[int]
    first_position: int
    block_table: list[int]
    state_slot: int = -1  # hybrid models: the slot of its Gated DeltaNet states
    checkpoint_at: int = -1  # save the state after this many of its tokens (-1: not now)
    checkpoint_entry: int = -1  # into this checkpoint
    hidden: torch.Tensor | None = None  # an MTP head's: a hidden state per token [n, H]
    position_states: int = -1  # hybrids: keep the state after each token here (BatchLayout)


class InputBuffers:
    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        hidden: tuple[int, torch.dtype] | None = None,
    ) -> None:
        """`max_seqs`: rows of a step (with speculative decoding, its sequences times the
        1 + k positions each verifies); `hidden`: the width and dtype of a hidden-state input
        per token (an MTP head's)."""

        def buf(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=device)

        self.block_size = block_size
        self.input_ids = buf(max_tokens, torch.long)
        self.positions = buf(max_tokens, torch.long)
        self.slot_mapping = buf(max_tokens, torch.long)
        # two past the requests: the end of the last one, then of the padding rows after it
        self.query_start_loc = buf(max_seqs + 2, torch.int32)
        self.seq_lens = buf(max_seqs, torch.int32)
        self.state_slots = buf(max_seqs, torch.int32).fill_(-1)  # -1: no request
        self.checkpoint_at = buf(max_seqs, torch.int32)
        self.checkpoint_entries = buf(max_seqs, torch.int32)
        self.position_states = buf(max_seqs, torch.int32)
        self.block_tables = buf(max_seqs * max_blocks_per_seq, torch.int32)
        self.sample_rows = buf(max_seqs, torch.long)
        self.hidden: torch.Tensor | None = None
        if hidden is not None:
            self.hidden = torch.zeros(max_tokens, hidden[0], dtype=hidden[1], device=device)

    @property
    def max_tokens(self) -> int:
        return self.input_ids.numel()

    def sizes(self) -> dict[str, int]:
        """Each buffer's length: a compiled forward's static shapes."""
        return {k: v.numel() for k, v in vars(self).items() if isinstance(v, torch.Tensor)}

    def fill(self, rows: list[BatchRow], num_decodes: int) -> BatchLayout:
        """Lay `rows` out in this order (the caller puts the `num_decodes` one-token rows
        first, as the attention backends expect)."""
        bs = self.block_size
        ids, pos, slots, starts, lens = [], [], [], [0], []
        for row in rows:
            span = range(row.first_position, row.first_position + len(row.token_ids))
            ids += row.token_ids
            pos += span
            slots += [row.block_table[p // bs] * bs + p % bs for p in span]
            starts.append(starts[-1] + len(span))
            lens.append(span.stop)
        width = max(len(row.block_table) for row in rows)
        tables = [
            b for row in rows for b in (*row.block_table, *[0] * (width - len(row.block_table)))
        ]
        self.write(self.input_ids, ids)
        self.write(self.positions, pos)
        self.write(self.slot_mapping, slots)
        self.write(self.seq_lens, lens)
        self.write(self.state_slots, [row.state_slot for row in rows])
        self.state_slots[len(rows) :] = -1  # no request: StateBuffers' padding slots
        self.write(self.checkpoint_at, [row.checkpoint_at for row in rows])
        self.write(self.checkpoint_entries, [row.checkpoint_entry for row in rows])
        self.write(self.position_states, [row.position_states for row in rows])
        self.write(self.block_tables, tables)
        tail = [starts[-1]] * (self.query_start_loc.numel() - len(starts))
        self.write(self.query_start_loc, starts + tail)
        if self.hidden is not None:
            self._write_hidden(rows)
        return self.layout(len(rows), width, len(ids), len(ids), num_decodes, max(lens))

    def pad(self, layout: BatchLayout, size: int) -> BatchLayout:
        """`layout` grown to `size` tokens for a graph of that size: the rows after its tokens
        write no KV slot and see no keys, so they cannot change the real rows' outputs."""
        start, b = layout.num_tokens, layout.num_reqs
        if size <= start:
            return layout
        self.query_start_loc[b + 1 :] = size
        self.input_ids[start:size] = 0
        self.positions[start:size] = 0
        self.slot_mapping[start:size] = -1
        if self.hidden is not None:
            self.hidden[start:size] = 0
        width = layout.block_tables.shape[1]
        return self.layout(b, width, size, layout.num_actual_tokens, layout.num_decodes,
                           layout.max_seq_len)  # fmt: skip

    def padding_layout(self, size: int) -> BatchLayout:
        """A batch of `size` padding tokens and no request: what graphs are captured on (their
        kernels depend on shapes only; the rows write nothing and read no key)."""
        self.query_start_loc[:1] = 0
        self.state_slots.fill_(-1)
        return self.pad(self.layout(0, 1, 0, 0, 0, 0), size)

    def layout(
        self, num_reqs: int, width: int, num_tokens: int, num_actual: int, num_decodes: int,
        max_seq_len: int,
    ) -> BatchLayout:  # fmt: skip
        return BatchLayout(
            positions=self.positions[:num_tokens],
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            state_slots=self.state_slots[:num_reqs],
            checkpoint_at=self.checkpoint_at[:num_reqs],
            checkpoint_entries=self.checkpoint_entries[:num_reqs],
            position_states=self.position_states[:num_reqs],
            block_tables=self.block_tables[: num_reqs * width].view(num_reqs, width),
            num_actual_tokens=num_actual,
            num_decodes=num_decodes,
            max_seq_len=max_seq_len,
            block_size=self.block_size,
            query_start_loc_buffer=self.query_start_loc,
            block_tables_buffer=self.block_tables,
            state_buffers=self.state_buffers(),
        )

    def state_buffers(self) -> StateBuffers:
        return StateBuffers(self.query_start_loc, self.seq_lens, self.state_slots,
                            self.checkpoint_at, self.checkpoint_entries,
                            self.position_states)  # fmt: skip

    def _write_hidden(self, rows: list[BatchRow]) -> None:
        if any(row.hidden is None for row in rows):
            raise ValueError("this runner's model reads a hidden state per token: rows need one")
        hidden = torch.cat([row.hidden for row in rows])
        self.hidden[: hidden.shape[0]].copy_(hidden)

    @staticmethod
    def write(buffer: torch.Tensor, values: list[int]) -> torch.Tensor:
        head = buffer[: len(values)]
        head.copy_(torch.tensor(values, dtype=buffer.dtype), non_blocking=True)
        return head
