"""The model runner's persistent input buffers. Each is its own contiguous tensor, sized for the
largest step; a step copies into the head of each and hands out views of that head, which are
contiguous too (block tables are stored flat so that a [B, W] view of the head is)."""

from __future__ import annotations

import torch


class InputBuffers:
    def __init__(
        self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device
    ) -> None:
        def buf(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=device)

        self.input_ids = buf(max_tokens, torch.long)
        self.positions = buf(max_tokens, torch.long)
        self.slot_mapping = buf(max_tokens, torch.long)
        # two past the requests: the end of the last one, then of the padding rows after it
        self.query_start_loc = buf(max_seqs + 2, torch.int32)
        self.seq_lens = buf(max_seqs, torch.int32)
        self.block_tables = buf(max_seqs * max_blocks_per_seq, torch.int32)
        self.token_kv_lens = buf(max_tokens, torch.int32)
        self.token_table_offsets = buf(max_tokens, torch.int32)
        self.sample_rows = buf(max_seqs, torch.long)

    def sizes(self) -> dict[str, int]:
        """Each buffer's length: a compiled forward's static shapes."""
        return {k: v.numel() for k, v in vars(self).items() if isinstance(v, torch.Tensor)}

    def fill_query_starts(self, starts: list[int]) -> torch.Tensor:
        """The requests' offsets, and their token count in every entry after them (a batch
        without padding); returns the [B + 1] head."""
        tail = [starts[-1]] * (self.query_start_loc.numel() - len(starts))
        return self.fill(self.query_start_loc, starts + tail)[: len(starts)]

    def pad(self, start: int, end: int, num_seqs: int) -> None:
        """Rows [start, end) after the tokens of `num_seqs` requests become padding for a graph
        of `end` tokens: they write no KV slot and see no keys, so they cannot change the real
        rows' outputs."""
        if end <= start:
            return
        self.query_start_loc[num_seqs + 1 :] = end
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = -1
        self.token_kv_lens[start:end] = 0
        self.token_table_offsets[start:end] = 0

    @staticmethod
    def fill(buffer: torch.Tensor, values: list[int]) -> torch.Tensor:
        head = buffer[: len(values)]
        head.copy_(torch.tensor(values, dtype=buffer.dtype), non_blocking=True)
        return head

    def fill_table(self, rows: list[list[int]], width: int) -> torch.Tensor:
        flat = [b for row in rows for b in (*row, *([0] * (width - len(row))))]
        return self.fill(self.block_tables, flat).view(len(rows), width)
