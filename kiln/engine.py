"""The engine: requests in, one scheduled batch per step, outputs out."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kiln.block_manager import BlockManager
from kiln.boot import BootPhases
from kiln.compilation.cache import CompileCacheEntry, check_cache_env, compile_root, open_for_plan
from kiln.compilation.capture import CaptureStats
from kiln.compilation.graphs import GraphBackend
from kiln.config import EngineConfig
from kiln.engine_plan import for_device, resolve_max_model_len, resolve_plan, select_attention
from kiln.errors import ConfigError, EngineClosedError, InvalidRequestError
from kiln.graph_boot import GraphBoot, graph_backend_for
from kiln.input_buffers import InputBuffers
from kiln.layers.linear import slow_cpu_dtype
from kiln.loader import open_model
from kiln.memory import available_memory, num_kv_blocks
from kiln.model_runner import ModelRunner, kv_bytes_per_block
from kiln.models import build_model
from kiln.models.weights import load_weights
from kiln.output_processor import OutputProcessor
from kiln.outputs import RequestMetrics, RequestOutput
from kiln.request import Request, new_sequences, validate_prompt
from kiln.sampler import SamplingBatch, sample
from kiln.sampling_params import SamplingParams
from kiln.scheduler import Scheduler
from kiln.sequence import Sequence, SequenceCounter

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_steps: int
    graphs: dict = field(default_factory=dict)  # runtime-mode step counts, graph misses

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig, graph_backend: GraphBackend | None = None) -> None:
        """`graph_backend`: how graphs are captured; by default CUDA graphs on a GPU and none
        elsewhere (tests pass the emulator to run the graph paths on the CPU)."""
        config, self.device = for_device(config)
        self.config = config
        self.dtype = config.torch_dtype
        self.boot = BootPhases(config.boot_timeout)
        t0 = time.monotonic()
        with self.boot.phase("load_model"):
            self._open_model()
        self.compile_cache: CompileCacheEntry | None = None
        try:
            with self.boot.phase("plan"):
                self._plan(graph_backend)
            num_blocks = self._boot_on_the_plan()
        finally:
            if self.compile_cache is not None:  # sealed by now, or abandoned by a failed boot
                self.compile_cache.release()
                self.compile_cache.deactivate()
        self.boot_s = time.monotonic() - t0
        logger.info(
            "engine ready in %.1f s (%s): %s, %d KV blocks of %d tokens",
            self.boot_s,
            ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in self.boot.durations.items()),
            self.model_config.architecture,
            num_blocks,
            config.cache.block_size,
        )

    def _boot_on_the_plan(self) -> int:
        self.graphs = GraphBoot(self.runner, self.graph_backend)
        with self.boot.phase("measure_graph_memory"):
            reserved = self.graphs.measure(self.dtype)
        with self.boot.phase("allocate_kv_cache"):
            num_blocks = self._allocate_kv_cache(reserved)
        self._init_requests(num_blocks)
        with self.boot.phase("warm_up"):  # compiles in mode 3
            self._warm_up()
        with self.boot.phase("capture_graphs"):
            self.graphs.capture()
        return num_blocks

    def _open_model(self) -> None:
        config = self.config
        self.source = open_model(config.model)
        self.model_config = self.source.config
        self.tokenizer = self.source.load_tokenizer()
        self.attn_backend = select_attention(config, self.model_config, self.device)
        self.model = self._load_model()

    def _plan(self, graph_backend: GraphBackend | None) -> None:
        """The graph plan, the compile cache it keys, and the runner that executes it."""
        self.max_model_len = resolve_max_model_len(self.config, self.model_config)
        self.plan = resolve_plan(self.config, self.attn_backend, self.device, graph_backend)
        self.compile_cache = self._open_compile_cache()
        self.graph_backend = graph_backend_for(self.plan, self.device, graph_backend)
        self.runner = ModelRunner(
            self.model,
            self.attn_backend,
            self.plan,
            self.config.cache.block_size,
            self._input_buffers(),
            self.device,
            self.graph_backend,
            *self._trace_dir(),
        )

    def _trace_dir(self) -> tuple[Path | None, str]:
        """The compile cache entry that keeps Dynamo's trace of the forward, or why none."""
        if self.compile_cache is None:
            return None, "mode 0"
        if not self.config.compilation.aot_compile:
            return None, '"aot_compile": false'
        return self.compile_cache.path, ""

    def _allocate_kv_cache(self, graph_reserve: int) -> int:
        num_blocks = self._size_kv_cache(graph_reserve)
        self.runner.allocate_kv_cache(num_blocks, self.dtype)
        if self.config.cache.kv_cache_memory is not None:
            free = available_memory(self.device)
            self.plan = self.graphs.fit_beside_fixed_kv(free, self.config.strict_graphs)
        return num_blocks

    def _init_requests(self, num_blocks: int) -> None:
        cache = self.config.cache
        self.blocks = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler, self.blocks)
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.closed = False
        self.seq_ids = SequenceCounter()
        self.generator = torch.Generator(self.device).manual_seed(self.config.seed)
        self.num_steps = 0
        # Debug/test hook: called with (sequences, raw logits [B, V]) before every sampling.
        self.logits_observer: Callable[[list[Sequence], torch.Tensor], None] | None = None

    @property
    def capture(self) -> CaptureStats:
        """Graphs captured at boot: how many, how long, the memory measured and reserved."""
        return self.graphs.stats

    @property
    def boot_phases(self) -> dict[str, float]:
        """Seconds per boot phase (`<phase>_s`) and in all (`boot_s`)."""
        phases = {f"{name}_s": seconds for name, seconds in self.boot.durations.items()}
        return {**phases, "boot_s": self.boot_s}

    def _load_model(self) -> torch.nn.Module:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = build_model(self.model_config, self.attn_backend)
        finally:
            torch.set_default_dtype(default_dtype)
        load_weights(model, self.source.tensors(self.dtype))
        model.finalize(self.device)
        warning = slow_cpu_dtype(self.dtype) if self.device.type == "cpu" else None
        if warning:
            logger.warning(warning)
        return model.eval()

    def _open_compile_cache(self) -> CompileCacheEntry | None:
        if self.plan.mode != 3:
            return None
        check_cache_env(compile_root(), self.config.strict_graphs)
        model = self.model_config.to_dict()
        entry = open_for_plan(self.plan.to_dict(), model, self.config.dtype, self.device)
        entry.activate()  # Inductor's and Triton's caches point into it until boot ends
        logger.info(
            "compile cache %s (%s; waited %.1f s for other processes)",
            entry.path,
            "reused" if entry.reused else "new",
            entry.waited_s,
        )
        return entry

    def _input_buffers(self) -> InputBuffers:
        sched = self.config.scheduler
        max_blocks = -(-self.max_model_len // self.config.cache.block_size)
        return InputBuffers(
            sched.max_num_batched_tokens, sched.max_num_seqs, max_blocks, self.device
        )

    def _warm_up(self) -> None:
        """A prefill step then a decode step, so compilation happens at boot, not on the first
        request; afterwards every recompilation is counted and warned about."""
        n = max(1, min(8, self.max_model_len - 3))
        self.add_request(
            "__kiln_warmup__", [1] * n, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        )
        self.step()
        self._check_trace_saved()
        self.runner.mark_warmed_up()
        while self.has_unfinished_requests():
            self.step()
        self.blocks.reset_prefix_cache()
        self.runner.counters = type(self.runner.counters)()
        self.num_steps = 0
        if self.compile_cache is not None:
            self.compile_cache.seal()
            stats = self.runner.compile_backend.stats
            reused = "reused" if self.compile_cache.reused else "new"
            logger.info(
                "torch.compile: %s (compile cache %s)", stats.summary(self.plan.backend), reused
            )

    def _check_trace_saved(self) -> None:
        """A trace that `aot_compile` could not save changes what later boots do: with
        --strict-graphs an error, before the compile cache entry is sealed without it."""
        backend = self.runner.compile_backend
        error = backend.stats.trace_error if backend is not None else None
        if error and self.config.strict_graphs:
            raise ConfigError(
                f'--strict-graphs: "aot_compile" is on, but Dynamo\'s trace of the forward '
                f"could not be saved ({error}), so every boot would trace it again. Remedy: "
                'set "aot_compile": false, or drop --strict-graphs'
            )

    def _size_kv_cache(self, graph_reserve: int = 0) -> int:
        bs = self.config.cache.block_size
        per_block = kv_bytes_per_block(self.model, bs, self.dtype)
        useful = -(-self.max_model_len // bs) * self.config.scheduler.max_num_seqs + 1
        blocks = num_kv_blocks(self.config.cache, per_block, self.device, useful, graph_reserve)
        if blocks * bs < self.max_model_len:
            raise ConfigError(
                f"the KV cache holds {blocks * bs} tokens ({blocks} blocks of {per_block} bytes), "
                f"fewer than max_model_len={self.max_model_len}: raise --kv-cache-memory "
                f"(to at least {-(-self.max_model_len // bs) * per_block / 2**20:.1f}MiB) or "
                "lower --max-model-len"
            )
        return blocks

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        params = params or SamplingParams()
        text, ids = self.prepare_prompt(prompt, params)
        self.add_prepared(request_id, text, ids, params, arrival_time)

    def prepare_prompt(
        self, prompt: str | list[int], params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """Tokenize and validate. Touches no engine state, so a server can call it from its
        request handlers while the engine loop runs."""
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        validate_prompt(ids, params, self.model_config.vocab_size, self.max_model_len)
        return text, ids

    def add_prepared(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        if self.closed:
            raise EngineClosedError("this engine was closed: build a new one to run requests")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        metrics = RequestMetrics(arrival_time or time.monotonic())
        seqs = new_sequences(
            request_id, ids, params, metrics, self.tokenizer.backend, self.device, self.seq_ids
        )
        self.requests[request_id] = Request(request_id, text, ids, params, seqs, metrics)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks. Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        return request.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:
        """Free the KV cache and the captured graphs now rather than whenever the garbage
        collector gets to them: an engine built next in this process sizes its KV cache from
        the device memory left free. Unfinished requests are dropped."""
        self.closed = True
        self.requests.clear()
        self.runner.release_memory()
        gc.collect()
        if self.graph_backend is not None:
            self.graph_backend.release()
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        logits, sampling_seqs = self.runner.execute(batch)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            self.blocks.register_computed_blocks(seq)
        self.num_steps += 1
        if sampling_seqs:
            self._append_samples(logits, sampling_seqs)
        outputs = []
        for request_id in dict.fromkeys(s.request_id for s in sampling_seqs):
            request = self.requests[request_id]
            outputs.append(request.output())
            if request.finished:
                del self.requests[request_id]
        return outputs

    def _append_samples(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        if self.logits_observer is not None:
            self.logits_observer(seqs, logits)
        batch = SamplingBatch.build(seqs, self.model_config.vocab_size, self.device)
        out = sample(logits, batch, self.tokenizer.eos_token_ids, self.generator)
        now = time.monotonic()
        for row, (seq, token) in enumerate(zip(seqs, out.token_ids)):
            logprob_row = out.logprobs[row] if out.logprobs is not None else None
            if self.output_processor.append(seq, token, logprob_row, now):
                self.scheduler.finish(seq)

    def capture_stats(self) -> dict[str, float]:
        """Graphs captured at boot: how many, how long, the memory measured and reserved."""
        return self.capture.to_dict()

    def compilation(self) -> dict | None:
        """What mode 3 compiled and how long it took, for /v1/engine (None in mode 0)."""
        if self.runner.compile_backend is None:
            return None
        st = self.runner.compile_backend.stats
        return {
            "backend": self.plan.backend,
            "compilations": st.compilations,
            "pieces": st.pieces,
            "compile_s": round(st.compile_s, 3),
            "backend_s": round(st.backend_s, 3),
            "dynamo_trace": st.trace,
            "trace_load_s": round(st.trace_load_s, 3),
        }

    def stats(self) -> EngineStats:
        b = self.blocks
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=b.num_free_blocks,
            num_blocks=b.num_blocks,
            kv_cache_usage=b.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queried_tokens=b.stats.queried_tokens,
            prefix_cache_hit_tokens=b.stats.hit_tokens,
            num_steps=self.num_steps,
            graphs=self.runner.counters.to_dict()
            | {
                "recompilations": self.runner.recompilations,
                "last_recompile_reason": self.runner.last_recompile_reason,
                "piecewise_input_copies": self.runner.graph_input_copies,
            },
        )
