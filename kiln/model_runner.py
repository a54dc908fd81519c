"""Turns a scheduled batch into model inputs, dispatches it to a runtime mode, runs the model
(eager or compiled) and returns the logits of the rows that sample. Owns the model, its paged
KV cache and the persistent input buffers."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.attention import AttentionBackend, AttentionMetadata
from kiln.compilation.backend import (
    PieceCompiler,
    SplitBackend,
    mark_dynamic_dims,
    model_guard_filter,
    own_forward,
    restorer_of_marks,
)
from kiln.compilation.dispatcher import Dispatch, GraphCounters, describe, dispatch
from kiln.compilation.dump import GraphDump, dump_root
from kiln.compilation.graphs import FullGraphs, GraphBackend, PiecewiseGraphs, RuntimeState
from kiln.compilation.plan import GraphPlan, RuntimeMode
from kiln.compilation.precompile import PrecompiledForward, TraceFile
from kiln.compilation.vec_isa_probe import VecIsaProbe, wants_probe
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


def piece_compiler(plan: GraphPlan, device: torch.device) -> PieceCompiler:
    path = plan.requested.debug_dump_path
    dump = GraphDump(dump_root(path), plan.backend) if path else None
    options = dict(plan.inductor_options)
    probe = VecIsaProbe() if wants_probe(device.type, plan.backend, options) else None
    return PieceCompiler(plan.backend or "inductor", plan.inductor_options, dump, probe)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        plan: GraphPlan,
        block_size: int,
        buffers: InputBuffers,
        device: torch.device,
        graph_backend: GraphBackend | None = None,
        trace_entry: Path | None = None,
        no_trace_file: str = "no compile cache entry",
    ) -> None:
        """`trace_entry`: the compile cache entry where mode 3 keeps Dynamo's trace
        (precompile.py); `no_trace_file`: why there is none."""
        self.model = model
        self.backend = backend
        self.plan = plan
        self.block_size = block_size
        self.buffers = buffers
        self.device = device
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.counters = GraphCounters()
        self.graphs_captured = False  # every graph of the plan (not the measurement's largest)
        self.compile_backend: SplitBackend | None = None
        self.forward = model.forward
        if plan.mode == 3:
            forward = own_forward(model)
            self.compile_backend = SplitBackend(
                plan.splitting_ops,
                plan.requested.debug_contiguity,
                piece_compiler(plan, device),
                traced_code=forward.__code__,
            )
            self.forward = PrecompiledForward(
                forward,
                self.compile_backend,
                model_guard_filter,
                self._trace_file(trace_entry),
                self._mark_for_trace,
                no_trace_file,
            )
        self.graph_backend = graph_backend
        self.full: FullGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        if graph_backend is not None:
            self._graph_wrappers(graph_backend)

    def _trace_file(self, entry: Path | None) -> TraceFile | None:
        if entry is None:
            return None
        # the weights' shapes too: the runner drops Dynamo's guards on them (model_guard_filter),
        # so a trace of other shapes (a tensor-parallel shard) would not be refused at a call
        tensors = [*self.model.named_parameters(), *self.model.named_buffers()]
        weights = [(name, list(t.shape), str(t.dtype)) for name, t in tensors]
        static = {"block_size": self.block_size, "buffers": self.buffers.sizes(), "model": weights}
        return TraceFile.in_entry(entry, self.device, static)

    def _graph_wrappers(self, graph_backend: GraphBackend) -> None:
        modes = {self.plan.decode_mode, self.plan.mixed_mode}
        if RuntimeMode.FULL in modes:
            self.full = FullGraphs(graph_backend)
        if RuntimeMode.PIECEWISE in modes and self.compile_backend is not None:
            self.piecewise = PiecewiseGraphs(graph_backend)
            self.compile_backend.piecewise = self.piecewise

    def allocate_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        cfg = self.model.config
        shape = (num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        # One tensor per layer and per K/V, never views of one big buffer: a compiled graph that
        # keeps the attention op inside (no split) mutates each cache in place only when it is
        # its own graph input; views of a shared base made Inductor copy the cache every step.
        # empty, not zeros: backends only ever read slots that were written (padding reads are
        # redirected), and zero-filling gigabytes would cost seconds at boot
        self.kv_caches = [
            (
                torch.empty(shape, dtype=dtype, device=self.device),
                torch.empty(shape, dtype=dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]
        for (k_cache, v_cache), attn in zip(self.kv_caches, self.model.attention_layers()):
            attn.bind_cache(k_cache, v_cache)

    def prepare(self, batch: ScheduledBatch) -> ModelInputs:
        """Lay the batch out decodes first, as the attention backends expect."""
        order = sorted(range(len(batch)), key=lambda i: batch.num_tokens[i] != 1)
        bs = self.block_size
        width = max(len(s.block_table) for s in batch.seqs)
        ids, pos, slots, starts, lens, tables, rows, sampling = [], [], [], [0], [], [], [], []
        kv_lens, offsets = [], []
        for row, i in enumerate(order):
            seq, n = batch.seqs[i], batch.num_tokens[i]
            first = seq.num_computed_tokens
            ids += seq.token_ids[first : first + n]
            span = range(first, first + n)
            pos += span
            kv_lens += range(first + 1, first + n + 1)
            offsets += [row * width] * n
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
            query_start_loc=b.fill_query_starts(starts),
            seq_lens=b.fill(b.seq_lens, lens),
            block_tables=b.fill_table(tables, width),
            num_actual_tokens=len(ids),
            num_decodes=sum(1 for n in query_lens if n == 1),
            max_seq_len=max(lens),
            token_kv_lens=b.fill(b.token_kv_lens, kv_lens),
            token_table_offsets=b.fill(b.token_table_offsets, offsets),
            block_tables_flat=b.block_tables,
            query_start_loc_padded=b.query_start_loc,
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
        mode = self._available(wanted)
        if wanted.promised and mode is RuntimeMode.NONE:
            self._record_miss(wanted)
        self.counters.record(mode)
        if mode is RuntimeMode.NONE:
            return self._forward(inputs.input_ids, inputs.positions, inputs.meta)
        size = wanted.descriptor.num_tokens
        meta = inputs.meta
        self.buffers.pad(meta.num_actual_tokens, size, meta.query_start_loc.numel() - 1)
        if mode is RuntimeMode.FULL:
            return self.full.run(size)
        return self._run_piecewise(inputs.meta, size)

    def _record_miss(self, wanted: Dispatch) -> None:
        """Counted always; the first after capture is logged too (warm-up runs before capture,
        so its steps miss by design)."""
        self.counters.record_miss(wanted)
        if self.graphs_captured and self.counters.misses == 1:
            logger.warning(
                "graph miss: the plan promised this step a graph (%s), but none was captured "
                "at that size, so it ran eagerly. kiln captures every size the plan lists, so "
                "this is a bug: please report it with `kiln info`'s graph plan. Later misses "
                "are counted (graphs.graph_misses, with examples), not logged",
                self.counters.miss_examples[0],
            )

    def _available(self, wanted: Dispatch) -> RuntimeMode:
        """The promised mode if its graph was captured; NONE (a miss) otherwise."""
        size = wanted.descriptor.num_tokens
        if wanted.mode is RuntimeMode.FULL and self.full is not None and self.full.has(size):
            return RuntimeMode.FULL
        pw = self.piecewise
        if wanted.mode is RuntimeMode.PIECEWISE and pw is not None and pw.has(size):
            return RuntimeMode.PIECEWISE
        return RuntimeMode.NONE

    def _run_piecewise(self, meta: AttentionMetadata, size: int) -> torch.Tensor:
        b = self.buffers
        padded = self._padded_meta(meta, size)
        self.piecewise.state = RuntimeState(RuntimeMode.PIECEWISE, size)
        try:
            return self._forward(b.input_ids[:size], b.positions[:size], padded)
        finally:
            self.piecewise.state = RuntimeState()

    def _padded_meta(self, meta: AttentionMetadata, size: int) -> AttentionMetadata:
        b = self.buffers
        return dataclasses.replace(
            meta,
            slot_mapping=b.slot_mapping[:size],
            token_kv_lens=b.token_kv_lens[:size],
            token_table_offsets=b.token_table_offsets[:size],
        )

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        stats = self.compile_backend.stats if self.compile_backend is not None else None
        if stats is None:
            return self.forward(input_ids, positions, meta)
        compilations, start = stats.compilations, time.perf_counter()
        out = self.forward(input_ids, positions, meta)
        if stats.compilations != compilations:  # this call compiled
            stats.compile_s += time.perf_counter() - start
        return out

    # ---- capture ------------------------------------------------------------------------

    def capture_sizes(self, mode: RuntimeMode) -> list[int]:
        """Sizes to capture for a runtime mode, largest first."""
        p = self.plan
        sizes = set()
        if p.decode_mode is mode:
            sizes |= set(p.decode_capture_sizes)
        if p.mixed_mode is mode:
            sizes |= set(p.mixed_capture_sizes)
        return sorted(sizes, reverse=True)

    @torch.inference_mode()
    def capture_graphs(self, only_largest: bool = False) -> int:
        """Warm up and capture every graph of the plan, largest size first (PIECEWISE, then
        FULL), all in the graph backend's one pool. Returns how many graphs were captured."""
        count = 0
        if self.piecewise is not None:
            for size in self.capture_sizes(RuntimeMode.PIECEWISE)[: 1 if only_largest else None]:
                count += self._capture_piecewise(size)
        if self.full is not None:
            for size in self.capture_sizes(RuntimeMode.FULL)[: 1 if only_largest else None]:
                self._capture_full(size)
                count += 1
        self.graphs_captured = not only_largest
        return count

    @torch.inference_mode()
    def warm_up_graphs(self) -> None:
        """One uncaptured forward at the largest capture size, as the captures run it: compiles
        (mode 3), loads kernels and allocates the capture stream's workspaces, so that graph
        memory read across the captures is the graphs' own."""
        sizes = self.capture_sizes(RuntimeMode.PIECEWISE) + self.capture_sizes(RuntimeMode.FULL)
        if not sizes or self.graph_backend is None:
            return
        self.graph_backend.warm_up(self._padded_forward(max(sizes)))

    def release_memory(self) -> None:
        """Drop the graphs and the KV cache (the engine is closing)."""
        self.drop_graphs()
        self.kv_caches = []
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = None

    def drop_graphs(self) -> None:
        if self.full is not None:
            self.full.graphs.clear()
        if self.piecewise is not None:
            self.piecewise.clear()

    def _padding_meta(self, size: int) -> AttentionMetadata:
        """A batch of `size` padding tokens and no request: what graphs are captured on (their
        kernels depend on shapes only; the rows write nothing and read no key)."""
        b = self.buffers
        b.query_start_loc[:1] = 0
        b.pad(0, size, 0)
        meta = AttentionMetadata(
            slot_mapping=b.slot_mapping[:size],
            query_start_loc=b.query_start_loc[:1],
            seq_lens=b.seq_lens[:0],
            block_tables=b.block_tables[:0].view(0, 1),
            num_actual_tokens=0,
            num_decodes=0,
            max_seq_len=0,
            token_kv_lens=b.token_kv_lens[:size],
            token_table_offsets=b.token_table_offsets[:size],
            block_tables_flat=b.block_tables,
            query_start_loc_padded=b.query_start_loc,
        )
        return self.backend.build_metadata(meta, self.block_size)

    def _padded_forward(self, size: int) -> Callable[[], torch.Tensor]:
        """The forward of a batch of `size` padding tokens, as graphs are captured on it."""
        b, meta = self.buffers, self._padding_meta(size)
        ids, pos = b.input_ids[:size], b.positions[:size]
        return lambda: self._forward(ids, pos, meta)

    def _capture_full(self, size: int) -> None:
        run = self._padded_forward(size)
        self.graph_backend.warm_up(run)  # this size's first call (autotuning, workspaces)
        self.full.capture(size, run)

    def _capture_piecewise(self, size: int) -> int:
        run = self._padded_forward(size)
        self.graph_backend.warm_up(run)
        before = len(self.piecewise.graphs)
        self.piecewise.state = RuntimeState(RuntimeMode.PIECEWISE, size, capturing=True)
        try:
            run()
        finally:
            self.piecewise.state = RuntimeState()
        self.piecewise.sizes.add(size)
        return len(self.piecewise.graphs) - before

    def _mark_for_trace(self, args: tuple) -> Callable[[], None]:
        """Before Dynamo traces a call: its token and batch dimensions unbacked, and the
        number of KV blocks dynamic (the graph-memory measurement compiles on a two-block
        cache, and the real cache must not recompile it: on a GPU that was a second full
        compilation at every boot). Returns what takes the KV caches' marks off again (the
        step's inputs are new tensors every step)."""
        restore = restorer_of_marks([t for pair in self.kv_caches for t in pair])
        mark_dynamic_dims(self._dynamic_inputs(*args))
        for k_cache, v_cache in self.kv_caches:
            torch._dynamo.mark_dynamic(k_cache, 0)
            torch._dynamo.mark_dynamic(v_cache, 0)
        return restore

    @staticmethod
    def _dynamic_inputs(
        input_ids: torch.Tensor, positions: torch.Tensor, m: AttentionMetadata
    ) -> list[tuple[torch.Tensor, list[int]]]:
        dims = [
            (input_ids, [0]),
            (positions, [0]),
            (m.slot_mapping, [0]),
            (m.query_start_loc, [0]),
            (m.seq_lens, [0]),
            (m.block_tables, [0, 1]),
            (m.token_kv_lens, [0]),
            (m.token_table_offsets, [0]),
        ]
        extra = [getattr(m, name, None) for name in ("decode_slots", "decode_bias")]
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
    def graph_input_copies(self) -> int:
        """Inputs a PIECEWISE replay had to copy to their captured address (0 by design)."""
        return self.piecewise.copies if self.piecewise is not None else 0

    @property
    def recompilations(self) -> int:
        return self.compile_backend.stats.recompilations if self.compile_backend else 0

    @property
    def last_recompile_reason(self) -> str | None:
        return self.compile_backend.stats.last_recompile_reason if self.compile_backend else None
