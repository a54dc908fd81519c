"""Turns a scheduled batch into model inputs, dispatches it to a runtime mode, runs the model
(eager, compiled, or a graph replay) and samples the rows that end their known tokens. Owns
the model, its paged KV cache, the persistent input buffers and the graphs the boot captured."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.attention.backend import AttentionBackend, AttentionMetadata, BatchLayout, StateMetadata
from kiln.attention.kv_int8 import cache_row_width
from kiln.compiler.precompile import TraceFile, compiled_forward
from kiln.compiler.split_backend import SplitBackend, mark_dynamic_dims, restorer_of_marks
from kiln.config.graph_plan import GraphPlan, RuntimeMode
from kiln.cudagraphs.dispatcher import Dispatch, GraphCounters, describe, dispatch
from kiln.cudagraphs.full import FullGraphs
from kiln.cudagraphs.graph_backend import GraphBackend
from kiln.cudagraphs.piecewise import PiecewiseGraphs, RuntimeState
from kiln.engine.executor import SampledTokens
from kiln.engine.scheduler import ScheduledBatch
from kiln.engine.sequence import Sequence
from kiln.models.interface import CausalModel
from kiln.runner.input_buffers import BatchRow, InputBuffers
from kiln.runner.padding import padded_token_count
from kiln.runner.sampler import SamplingBatch, sample
from kiln.runner.state_pool import StatePool
from kiln.runner.step_inputs import StepInputs, sample_rows_of, seq_starts_of
from kiln.runner.verify import verify

logger = logging.getLogger(__name__)

LogitsObserver = Callable[[list[Sequence], torch.Tensor], None]


@dataclass(frozen=True)
class Sampling:
    """What the sampler needs beyond the batch: the vocabulary, the end-of-sequence tokens and
    the generator of unseeded requests (seeded by the engine's seed)."""

    vocab_size: int
    eos_token_ids: frozenset[int]
    seed: int


class ModelRunner:
    def __init__(
        self,
        model: CausalModel,
        attn_backend: AttentionBackend,
        plan: GraphPlan,
        buffers: InputBuffers,
        sampling: Sampling,
        device: torch.device,
        trace_entry: Path | None = None,
        no_trace_file: str = "no compile cache entry",
        num_state_checkpoints: int = 0,
        trace_role: str = "target",
        position_state_rows: tuple[int, int, int] = (0, 0, 0),
    ) -> None:
        """`trace_entry`: the compile cache entry where mode 3 keeps Dynamo's trace
        (kiln/compiler/precompile.py); `no_trace_file`: why there is none;
        `num_state_checkpoints`: a hybrid model's prefix-cache state pool (state_checkpoints.py);
        `trace_role`: "target", or "drafter" for a speculative drafter's runner, whose trace
        lies in the target's entry beside the target's; `position_state_rows`: a hybrid's
        per-token verification states (state_pool.py)."""
        self.trace_role = trace_role
        self.model, self.attn_backend, self.plan = model, attn_backend, plan
        self.buffers, self.device = buffers, device
        self.attn_builder = attn_backend.metadata_builder(buffers.max_tokens, device)
        self.sampling = sampling
        self.generator = torch.Generator(device).manual_seed(sampling.seed)
        self.logits_observer: LogitsObserver | None = None  # tests: the logits tokens came from
        # an MTP proposer reads the hidden state of every token of the last step
        self.keep_hidden = False
        self.last_step: tuple[StepInputs, torch.Tensor] | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.linear_layers = model.linear_layers()
        # before the compiled forward below: its trace file is keyed by the pools' sizes
        self.states = StatePool(self.linear_layers, device, num_state_checkpoints,
                                position_state_rows)  # fmt: skip
        self.counters = GraphCounters()
        self.graphs_captured = False  # set by the boot once every graph of the plan is
        self.pad_eager_steps = False  # kiln/runner/padding.py; set by the boot
        self.compile_backend: SplitBackend | None = None
        self.forward: Callable[..., torch.Tensor] = model.forward
        if plan.mode == 3:
            trace_file = self._trace_file(trace_entry)
            self.forward = compiled_forward(
                model, plan, device, trace_file, self._mark_for_trace, no_trace_file
            )
            self.compile_backend = self.forward.backend
        self.graph_backend: GraphBackend | None = None
        self.full: FullGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None

    def _trace_file(self, entry: Path | None) -> TraceFile | None:
        if entry is None:
            return None
        # the weights' shapes too: the runner drops Dynamo's guards on them (model_guard_filter),
        # so a trace of other shapes (a tensor-parallel shard) would not be refused at a call
        tensors = [*self.model.named_parameters(), *self.model.named_buffers()]
        weights = [(name, list(t.shape), str(t.dtype)) for name, t in tensors]
        block_size = self.buffers.block_size
        static = {"block_size": block_size, "buffers": self.buffers.sizes(), "model": weights,
                  "role": self.trace_role}  # fmt: skip
        if self.linear_layers:  # the state pools are inputs of fixed size: the trace guards them
            static |= self.states.trace_key()
        # Dynamo's global-state guard holds the thread count: a trace saved with another would
        # fail at every boot and be traced again
        static["threads"] = torch.get_num_threads()
        return TraceFile.in_entry(entry, self.device, static)

    def attach_graphs(self, graph_backend: GraphBackend | None) -> None:
        """The graph sets the plan's runtime modes replay, captured through `graph_backend`
        (none: the plan captures nothing)."""
        self.graph_backend = graph_backend
        if graph_backend is None:
            return
        modes = {self.plan.decode_mode, self.plan.mixed_mode}
        if RuntimeMode.FULL in modes:
            self.full = FullGraphs(graph_backend)
        if RuntimeMode.PIECEWISE in modes and self.compile_backend is not None:
            self.piecewise = PiecewiseGraphs(graph_backend)
            self.compile_backend.piecewise = self.piecewise

    def allocate_kv_cache(
        self, num_blocks: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
    ) -> None:
        """The paged KV cache in `kv_dtype` (default `dtype`, the model's) and the hybrid
        models' state slots in `dtype`."""
        cfg, attention = self.model.config, self.model.attention_layers()
        row = cache_row_width(cfg.head_dim, kv_dtype or dtype)  # int8 rows carry their scale
        shape = (num_blocks, self.buffers.block_size, cfg.num_kv_heads, row)
        # One tensor per layer and per K/V, never views of one big buffer: a compiled graph that
        # keeps the attention op inside (no split) mutates each cache in place only when it is
        # its own graph input; views of a shared base made Inductor copy the cache every step.
        # empty, not zeros: backends only ever read slots that were written (padding reads are
        # redirected), and zero-filling gigabytes would cost seconds at boot
        self.kv_caches = [
            (
                torch.empty(shape, dtype=kv_dtype or dtype, device=self.device),
                torch.empty(shape, dtype=kv_dtype or dtype, device=self.device),
            )
            for _ in attention
        ]
        for (k_cache, v_cache), attn in zip(self.kv_caches, attention):
            attn.bind_cache(k_cache, v_cache)
        self.states.allocate(self.buffers.seq_lens.numel(), dtype)

    # ---- one step -----------------------------------------------------------------------

    @torch.inference_mode()
    def forward_logits(self, batch: ScheduledBatch) -> tuple[StepInputs, torch.Tensor | None]:
        """Run the batch; the logits of its sample rows (None when no sequence samples)."""
        inputs, hidden = self.forward_hidden(batch)
        if hidden is None:
            return inputs, None
        return inputs, self.model.compute_logits(hidden)

    @torch.inference_mode()
    def forward_hidden(self, batch: ScheduledBatch) -> tuple[StepInputs, torch.Tensor | None]:
        """Run the batch; the final hidden states of its sample rows (None when no sequence
        samples). With `keep_hidden`, every token's stays readable until the next step."""
        inputs = self.prepare(batch)
        hidden = self._run(inputs)
        if self.keep_hidden:  # a graph's output buffer: valid until the next replay
            self.last_step = inputs, hidden[: inputs.layout.num_actual_tokens]
        if not inputs.sampling_seqs:
            return inputs, None
        return inputs, hidden[inputs.sample_rows]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> SampledTokens:
        inputs, logits = self.forward_logits(batch)
        seqs = inputs.sampling_seqs
        if logits is None:
            return SampledTokens([], [], None)
        if any(inputs.drafts):
            return self._verify(logits, seqs, inputs.drafts, inputs.position_states)
        if self.logits_observer is not None:
            self.logits_observer(seqs, logits)
        rows = SamplingBatch.build(seqs, self.sampling.vocab_size, self.device)
        out = sample(logits, rows, self.sampling.eos_token_ids, self.generator)
        return SampledTokens(seqs, [[t] for t in out.token_ids], out.logprobs)

    def _verify(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
        position_states: list[int],
    ) -> SampledTokens:  # fmt: skip
        # a draft model's distributions, where it drew its drafts (n-gram drafts have none)
        q = [s.spec_probs[: len(d)] if s.spec_probs is not None else None
             for s, d in zip(seqs, drafts)]  # fmt: skip
        eos = self.sampling.eos_token_ids
        done = verify(logits, seqs, drafts, eos, self.generator, q)
        if self.logits_observer is not None:  # the rows the kept tokens came from
            kept = [
                (s, first + j)
                for s, first, ids in zip(seqs, done.first_rows, done.token_ids)
                for j in range(len(ids))
            ]
            self.logits_observer([s for s, _ in kept], logits[[r for _, r in kept]])
        num_drafts = [len(d) for d in drafts]
        out = SampledTokens(seqs, done.token_ids, done.logprobs, done.first_rows, num_drafts)
        if self.linear_layers:
            rejected = [out.num_rejected(i) for i in range(len(seqs))]
            kept = [n - lost + 1 for n, lost in zip(num_drafts, rejected)]
            self.states.keep_verified(seqs, kept, rejected, position_states)
        return out

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Lay the batch out decodes first, as the attention backends expect. A sequence's
        speculative drafts follow its last token, as decode rows of their own where the
        backend takes them so (`drafts_as_decode_rows`), and each of its positions samples."""
        # a Gated DeltaNet state advances through one row per sequence: runs for hybrids
        as_rows = self.attn_backend.drafts_as_decode_rows and not self.linear_layers
        rows: list[BatchRow] = []
        owners: list[int] = []  # per row: the sampling sequence it samples for, or -1
        row_seqs: list[int] = []  # per row: its sequence's index in the batch
        sampling, drafts = [], []
        position_states: list[int] = []  # per sampling sequence: see `_position_states`
        for index, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            first = seq.num_computed_tokens
            num_drafts = max(0, first + n - seq.num_tokens)
            tokens = seq.token_ids[first : first + n] + seq.spec_token_ids[:num_drafts]
            if seq.restore_entry >= 0:  # a prefix hit starts from the state saved after it
                self.states.restore(seq.restore_entry, seq.state_slot)
                seq.restore_entry = -1
            owner = len(sampling) if first + n >= seq.num_tokens else -1
            at = self._position_states(position_states) if num_drafts else -1
            if owner >= 0:
                sampling.append(seq)
                drafts.append(seq.spec_token_ids[:num_drafts])
                position_states.append(at)
            if num_drafts and as_rows:
                rows += [BatchRow([t], first + j, seq.block_table) for j, t in enumerate(tokens)]
                owners += [owner] * len(tokens)
                row_seqs += [index] * len(tokens)
            else:
                rows.append(BatchRow(tokens, first, seq.block_table, seq.state_slot,
                                     seq.checkpoint_at, seq.checkpoint_entry,
                                     getattr(seq, "hidden_in", None), at))  # fmt: skip
                owners.append(owner)
                row_seqs.append(index)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].token_ids) != 1)
        rows, owners = [rows[i] for i in order], [owners[i] for i in order]
        sample_rows = sample_rows_of(rows, owners, drafts)
        query_lens = [len(row.token_ids) for row in rows]
        layout = self.buffers.fill(rows, query_lens.count(1))
        sample_at = InputBuffers.write(self.buffers.sample_rows, sample_rows)
        starts = seq_starts_of(query_lens, [row_seqs[i] for i in order], len(batch.seqs))
        return StepInputs(layout, query_lens, sample_at, sampling, drafts, starts, position_states)

    def _position_states(self, taken: list[int]) -> int:
        """A hybrid's verifying sequence: the first of the state rows its run keeps its
        per-token states in; -1 for attention-only models."""
        return self.states.position_row(taken) if self.linear_layers else -1

    def _run(self, inputs: StepInputs) -> torch.Tensor:
        wanted = dispatch(self.plan, describe(inputs.query_lens))
        mode = self._available(wanted)
        if wanted.promised and mode is RuntimeMode.NONE:
            self._record_miss(wanted)
        self.counters.record(mode)
        layout = inputs.layout
        if mode is not RuntimeMode.NONE:
            layout = self.buffers.pad(layout, wanted.descriptor.num_tokens)
        elif self.pad_eager_steps:
            size = padded_token_count(layout.num_tokens, self.buffers.max_tokens)
            layout = self.buffers.pad(layout, size)
        args = self.model_inputs(layout)  # a FULL graph reads them where they were written
        if mode is RuntimeMode.FULL:
            return self.full.run(layout.num_tokens)
        if mode is RuntimeMode.NONE:
            return self._forward(*args)
        self.piecewise.state = RuntimeState(RuntimeMode.PIECEWISE, layout.num_tokens)
        try:
            return self._forward(*args)
        finally:
            self.piecewise.state = RuntimeState()

    def model_inputs(
        self, layout: BatchLayout
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The forward's arguments for a laid-out batch: token ids, positions, and the
        attention backend's metadata built from the layout."""
        meta = self.attn_builder.build(layout)
        if self.linear_layers:
            meta.state = StateMetadata.of(layout)
        if self.buffers.hidden is not None:
            meta.mtp_hidden = self.buffers.hidden[: layout.num_tokens]
        return self.buffers.input_ids[: layout.num_tokens], layout.positions, meta

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

    def padded_forward(self, size: int) -> Callable[[], torch.Tensor]:
        """The forward of a batch of `size` padding tokens, as graphs are captured on it."""
        args = self.model_inputs(self.buffers.padding_layout(size))
        return lambda: self._forward(*args)

    def _mark_for_trace(self, args: tuple) -> Callable[[], None]:
        """Before Dynamo traces a call: its token and batch dimensions unbacked, and the
        number of KV blocks dynamic (the graph-memory measurement compiles on a two-block
        cache, and the real cache must not recompile it: on a GPU that was a second full
        compilation at every boot). Returns what takes the KV caches' marks off again (the
        step's inputs are new tensors every step)."""
        restore = restorer_of_marks([t for pair in self.kv_caches for t in pair])
        input_ids, positions, meta = args
        mark_dynamic_dims([(input_ids, [0]), (positions, [0]), *meta.dynamic_tensors()])
        for k_cache, v_cache in self.kv_caches:
            torch._dynamo.mark_dynamic(k_cache, 0)
            torch._dynamo.mark_dynamic(v_cache, 0)
        return restore

    # ---- what the engine reads and frees --------------------------------------------------

    def graph_stats(self) -> dict[str, Any]:
        return self.counters.to_dict() | {
            "recompilations": self.recompilations,
            "last_recompile_reason": self.last_recompile_reason,
            "piecewise_input_copies": self.piecewise.copies if self.piecewise else 0,
        }

    def compile_stats(self) -> dict[str, Any] | None:
        if self.compile_backend is None:
            return None
        st = self.compile_backend.stats
        return {
            "backend": self.plan.backend,
            "compilations": st.compilations,
            "pieces": st.pieces,
            "compile_s": round(st.compile_s, 3),
            "backend_s": round(st.backend_s, 3),
            "dynamo_trace": st.trace,
            "trace_load_s": round(st.trace_load_s, 3),
            "summary": st.summary(self.plan.backend),
        }

    def reset_counters(self) -> None:
        self.counters = GraphCounters()

    def mark_warmed_up(self) -> None:
        """Compilations from now on are recompilations: counted and warned about."""
        if self.compile_backend is not None:
            self.compile_backend.stats.warmed_up = True

    def release_memory(self) -> None:
        """Drop the graphs and the KV cache (the engine is closing)."""
        self.drop_graphs()
        self.kv_caches = []
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = None
        if self.graph_backend is not None:
            self.graph_backend.release()
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()

    def drop_graphs(self) -> None:
        if self.full is not None:
            self.full.graphs.clear()
        if self.piecewise is not None:
            self.piecewise.clear()

    @property
    def recompilations(self) -> int:
        return self.compile_backend.stats.recompilations if self.compile_backend else 0

    @property
    def last_recompile_reason(self) -> str | None:
        return self.compile_backend.stats.last_recompile_reason if self.compile_backend else None
