"""Turns a scheduled batch into model inputs, runs the model and returns the logits of the
rows that sample. Owns the model and its paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.attention import AttentionBackend, AttentionMetadata
from kiln.models.llama import CausalLM
from kiln.scheduler import ScheduledBatch
from kiln.sequence import Sequence


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # index of the last token of each sampling sequence
    sampling_seqs: list[Sequence]


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(
        self, model: CausalLM, backend: AttentionBackend, block_size: int, device: torch.device
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.kv_cache: torch.Tensor | None = None

    def allocate_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        cfg = self.model.config
        shape = (cfg.num_layers, 2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        # empty, not zeros: backends only ever read slots that were written (padding reads are
        # redirected), and zero-filling gigabytes would cost seconds at boot
        self.kv_cache = torch.empty(shape, dtype=dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.bind_cache(self.kv_cache[i, 0], self.kv_cache[i, 1])

    def prepare(self, batch: ScheduledBatch) -> ModelInputs:
        """Lay the batch out decodes first, as the attention backends expect."""
        order = sorted(range(len(batch)), key=lambda i: batch.num_tokens[i] != 1)
        bs = self.block_size
        ids, pos, slots, starts, lens, tables, sample_rows, sampling = (
            [],
            [],
            [],
            [0],
            [],
            [],
            [],
            [],
        )
        for i in order:
            seq, n = batch.seqs[i], batch.num_tokens[i]
            first = seq.num_computed_tokens
            ids += seq.token_ids[first : first + n]
            span = range(first, first + n)
            pos += span
            slots += [seq.block_table[p // bs] * bs + p % bs for p in span]
            starts.append(starts[-1] + n)
            lens.append(first + n)
            tables.append(seq.block_table)
            if first + n == seq.num_tokens:
                sample_rows.append(starts[-1] - 1)
                sampling.append(seq)
        width = max(len(t) for t in tables)
        table = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.long),
            query_start_loc=tensor(starts, torch.int32),
            seq_lens=tensor(lens, torch.int32),
            block_tables=tensor(table, torch.int32),
            num_actual_tokens=len(ids),
            num_decodes=sum(1 for i in order if batch.num_tokens[i] == 1),
            max_seq_len=max(lens),
        )
        meta = self.backend.build_metadata(meta, bs)
        return ModelInputs(
            tensor(ids, torch.long),
            tensor(pos, torch.long),
            meta,
            tensor(sample_rows, torch.long),
            sampling,
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one step; returns logits [num_sampling, V] and the sequences they belong to."""
        inputs = self.prepare(batch)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if not inputs.sampling_seqs:
            return hidden.new_empty(0, self.model.config.vocab_size), []
        return self.model.compute_logits(hidden[inputs.sample_rows]), inputs.sampling_seqs
