"""Turns a scheduled batch into model inputs, dispatches it to a runtime mode, runs the model
(eager or compiled) and returns the logits of the rows that sample. Owns the model, its paged
KV cache and the persistent input buffers."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kiln.attention import AttentionBackend, AttentionMetadata
from kiln.compilation.backend import SplitBackend, mark_dynamic_dims
from kiln.compilation.dispatcher import GraphCounters, describe, dispatch
from kiln.compilation.plan import GraphPlan, RuntimeMode
from kiln.input_buffers import InputBuffers
from kiln.models.llama import CausalLM
from kiln.scheduler import ScheduledBatch
from kiln.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # index of the last token of each sampling sequence
    sampling_seqs: list[Sequence]
    query_lens: list[int]


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        plan: GraphPlan,
        block_size: int,
        buffers: InputBuffers,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.plan = plan
        self.block_size = block_size
        self.buffers = buffers
        self.device = device
        self.kv_cache: torch.Tensor | None = None
        self.counters = GraphCounters()
        self.compile_backend: SplitBackend | None = None
        self.forward = model.forward
        if plan.mode == 3:
            self.compile_backend = SplitBackend(plan.splitting_ops, plan.requested.debug_contiguity)
            self.forward = torch.compile(
                model.forward, backend=self.compile_backend, fullgraph=True
            )

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
        ids, pos, slots, starts, lens, tables, rows, sampling = [], [], [], [0], [], [], [], []
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
                rows.append(starts[-1] - 1)
                sampling.append(seq)
        b = self.buffers
        query_lens = [batch.num_tokens[i] for i in order]
        meta = AttentionMetadata(
            slot_mapping=b.fill(b.slot_mapping, slots),
            query_start_loc=b.fill(b.query_start_loc, starts),
            seq_lens=b.fill(b.seq_lens, lens),
            block_tables=b.fill_table(tables, max(len(t) for t in tables)),
            num_actual_tokens=len(ids),
            num_decodes=sum(1 for n in query_lens if n == 1),
            max_seq_len=max(lens),
        )
        meta = self.backend.build_metadata(meta, bs)
        return ModelInputs(
            b.fill(b.input_ids, ids),
            b.fill(b.positions, pos),
            meta,
            b.fill(b.sample_rows, rows),
            sampling,
            query_lens,
        )

    def _run(self, inputs: ModelInputs) -> torch.Tensor:
        wanted = dispatch(self.plan, describe(inputs.query_lens))
        # No CUDA graphs are captured in this build: a promised graph would be a miss.
        if wanted.promised:
            self.counters.record_miss(wanted)
        self.counters.record(RuntimeMode.NONE)
        if self.compile_backend is not None:
            mark_dynamic_dims(self._dynamic_inputs(inputs))
        return self.forward(inputs.input_ids, inputs.positions, inputs.meta)

    @staticmethod
    def _dynamic_inputs(inputs: ModelInputs) -> list[tuple[torch.Tensor, list[int]]]:
        m = inputs.meta
        dims = [
            (inputs.input_ids, [0]),
            (inputs.positions, [0]),
            (m.slot_mapping, [0]),
            (m.query_start_loc, [0]),
            (m.seq_lens, [0]),
            (m.block_tables, [0, 1]),
        ]
        extra = [getattr(m, name) for name in ("decode_slots", "decode_bias")]
        return dims + [(t, [0]) for t in extra if isinstance(t, torch.Tensor)]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one step; returns logits [num_sampling, V] and the sequences they belong to."""
        inputs = self.prepare(batch)
        hidden = self._run(inputs)
        if not inputs.sampling_seqs:
            return hidden.new_empty(0, self.model.config.vocab_size), []
        return self.model.compute_logits(hidden[inputs.sample_rows]), inputs.sampling_seqs

    def mark_warmed_up(self) -> None:
        if self.compile_backend is not None:
            self.compile_backend.stats.warmed_up = True

    @property
    def recompilations(self) -> int:
        return self.compile_backend.stats.recompilations if self.compile_backend else 0
