"""Building an engine, phase by phase, each timed and watched (phases.py): load the model,
resolve the graph plan and the compile cache entry it keys, measure graph memory, size and
allocate the KV cache beside it, warm up (compiling in mode 3), capture the graphs."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from kiln.attention.backend import AttentionBackend
from kiln.boot.capture import GraphCapture, graph_backend_for
from kiln.boot.cpu_linears import choose_packed_activations, lay_out_cpu_linears
from kiln.boot.draft import (
    build_draft_runner,
    capture_draft_graphs,
    draft_bytes_per_block,
    finish_draft,
    load_draft,
    measure_draft_graphs,
)
from kiln.boot.host_memory import fault_in, keep_freed_memory
from kiln.boot.kv_cache import available_memory, size_kv_cache
from kiln.boot.phases import BootPhases
from kiln.boot.prefill_weights import keep_dense_copies
from kiln.boot.preview import (
    for_device,
    keyed_model,
    kv_dtype,
    resolve_max_model_len,
    resolve_plan,
    select_attention,
    torch_dtype,
)
from kiln.compile_cache.entry import (
    CompileCacheEntry,
    check_cache_env,
    compile_root,
    open_for_plan,
)
from kiln.config.engine import EngineConfig
from kiln.config.graph_plan import GraphPlan
from kiln.cudagraphs.graph_backend import GraphBackend
from kiln.engine.heap import freeze_boot_heap
from kiln.engine.llm_engine import BootReport, LLMEngine
from kiln.engine.state_checkpoints import num_state_checkpoints
from kiln.errors import ConfigError
from kiln.layers.int4_kernel import describe_int4_kernel
from kiln.layers.linear import slow_cpu_dtype
from kiln.loader import ModelSource, open_model
from kiln.loader.tokenizer import Tokenizer
from kiln.models import build_model, build_on
from kiln.models.interface import CausalModel
from kiln.models.weights import describe_weights, load_weights, weight_summary
from kiln.runner.input_buffers import InputBuffers
from kiln.runner.model_runner import ModelRunner, Sampling
from kiln.runner.padding import pads_eager_steps
from kiln.sampling_params import SamplingParams
from kiln.spec.speculator import check_speculation, verified_tokens_per_seq

logger = logging.getLogger(__name__)

WARM_UP_REQUEST = "__kiln_warmup__"


def build_engine(config: EngineConfig, graph_backend: GraphBackend | None = None) -> LLMEngine:
    """`graph_backend`: how graphs are captured; by default CUDA graphs on a GPU and none
    elsewhere (tests pass the emulator to run the graph paths on the CPU)."""
    config, device = for_device(config)
    if device.type == "cpu" and keep_freed_memory():
        logger.info("CPU: freed memory is kept for reuse (glibc mmap threshold 1 GiB, no trim)")
    dtype, phases, t0 = torch_dtype(config), BootPhases(config.boot_timeout), time.monotonic()
    with phases.phase("load_model"):
        source = open_model(config.model)
        check_speculation(config.speculative, source.config)
        tokenizer = (
            Tokenizer.from_directory(config.tokenizer, source.config.eos_token_ids)
            if config.tokenizer
            else source.load_tokenizer()
        )
        attn_backend = select_attention(config, source.config, device)
        model = load_model(source, attn_backend, config, device)
        draft = load_draft(config, model, device, load_model)
    entry: CompileCacheEntry | None = None
    try:
        with phases.phase("plan"):
            max_model_len = resolve_max_model_len(config, source.config)
            plan = resolve_plan(config, attn_backend, device, graph_backend, source.config)
            entry = open_compile_cache(plan, config, source, device, attn_backend)
            runner = _runner(model, attn_backend, plan, config, max_model_len, tokenizer, entry,
                             device)  # fmt: skip
            runner.attach_graphs(graph_backend_for(plan, device, graph_backend))
            if draft is not None:
                build_draft_runner(draft, config, max_model_len, tokenizer, device, graph_backend,
                                   trace_place(config, entry))  # fmt: skip
        capture = GraphCapture(runner)
        with phases.phase("measure_graph_memory"):
            kv = kv_dtype(config)
            reserved = capture.measure(dtype, kv) + measure_draft_graphs(draft, dtype, kv)
        with phases.phase("allocate_kv_cache"):
            num_blocks = _allocate_kv_cache(config, source, capture, max_model_len, reserved,
                                            draft_bytes_per_block(draft, config))  # fmt: skip
        boot = _report(source, runner, entry)
        engine = LLMEngine(
            config, source.config, tokenizer, runner, num_blocks, max_model_len, boot
        )
        if draft is not None:
            engine.speculator.draft_model = finish_draft(draft, config, num_blocks, runner)
        with phases.phase("warm_up"):  # compiles in mode 3
            warm_up(engine, runner)
            _seal(entry, runner)
        with phases.phase("capture_graphs"):
            capture.capture()
            capture_draft_graphs(draft)
    finally:
        if entry is not None:  # sealed by now, or abandoned by a failed boot
            entry.release()
            entry.deactivate()
    boot.capture, boot.phases_s = capture.stats, dict(phases.durations)
    freeze_boot_heap()
    boot.boot_s = time.monotonic() - t0
    logger.info(
        "engine ready in %.1f s (%s): %s, %d KV blocks of %d tokens (%s)",
        boot.boot_s,
        ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in phases.durations.items()),
        source.config.architecture,
        num_blocks,
        config.cache.block_size,
        str(kv_dtype(config)).removeprefix("torch."),
    )
    return engine


def load_model(
    source: ModelSource, attn_backend: AttentionBackend, config: EngineConfig, device: torch.device
) -> CausalModel:
    dtype = torch_dtype(config)
    model = build_on(device, dtype, lambda: build_model(source.config, attn_backend))
    load_weights(model, source.tensors(dtype, keep_packed=config.quantization == "auto"))
    model.finalize(device)
    if device.type == "cpu":
        lay_out_cpu_linears(model, dtype, config.cpu_linears)
    keep_dense_copies(model, dtype, device, config.prefill_weights, config.cpu_linears)
    model.weight_summary = weight_summary(model)
    logger.info("weights: %s", describe_weights(model.weight_summary))
    if device.type == "cpu" and any("int4 packed" in fmt for fmt, _, _ in model.weight_summary):
        rows = choose_packed_activations(model, config.packed_activations, config.strict_graphs)
        logger.info("int4 matmul of decode rows: %s, rows %s", describe_int4_kernel(), rows)
    warning = slow_cpu_dtype(dtype) if device.type == "cpu" else None
    if warning:
        logger.warning(warning)
    return model.eval()


def open_compile_cache(
    plan: GraphPlan,
    config: EngineConfig,
    source: ModelSource,
    device: torch.device,
    attention: AttentionBackend,
) -> CompileCacheEntry | None:
    """Mode 3's compile cache entry, active (Inductor's and Triton's caches point into it)
    until boot ends."""
    if plan.mode != 3:
        return None
    check_cache_env(compile_root(), config.strict_graphs)
    model_key = keyed_model(source, config, attention)
    entry = open_for_plan(plan.to_dict(), model_key, config.dtype, device)
    entry.activate()
    logger.info(
        "compile cache %s (%s; waited %.1f s for other processes)",
        entry.path,
        "reused" if entry.reused else "new",
        entry.waited_s,
    )
    return entry


def _runner(
    model: CausalModel,
    attn_backend: AttentionBackend,
    plan: GraphPlan,
    config: EngineConfig,
    max_model_len: int,
    tokenizer: Tokenizer,
    entry: CompileCacheEntry | None,
    device: torch.device,
) -> ModelRunner:
    sched, block_size = config.scheduler, config.cache.block_size
    max_blocks = -(-max_model_len // block_size)
    max_rows = sched.max_num_seqs * verified_tokens_per_seq(config.speculative)
    buffers = InputBuffers(sched.max_num_batched_tokens, max_rows, max_blocks, block_size, device)
    sampling = Sampling(model.config.vocab_size, tokenizer.eos_token_ids, config.seed)
    trace_entry, no_trace = trace_place(config, entry)
    checkpoints = num_state_checkpoints(config, model.config.is_hybrid)
    position_rows = (0, 0, 0)
    if model.config.is_hybrid and (spec := config.speculative) is not None:
        # k state rows for each sequence that may verify drafts in a step, after the slots
        verifying = min(sched.max_num_seqs, spec.batch_size_limit)
        position_rows = (sched.max_num_seqs, verifying, spec.num_speculative_tokens)
    runner = ModelRunner(model, attn_backend, plan, buffers, sampling, device, trace_entry,
                         no_trace, checkpoints, position_state_rows=position_rows)  # fmt: skip
    runner.pad_eager_steps = pads_eager_steps(config.eager_step_padding, device.type)
    return runner


def trace_place(config: EngineConfig, entry: CompileCacheEntry | None) -> tuple[Path | None, str]:
    """Where mode 3 saves Dynamo's trace (the compile cache entry), or why it saves none."""
    if entry is None:
        return None, "mode 0"
    if not config.compilation.aot_compile:
        return None, '"aot_compile": false'
    return entry.path, ""


def _allocate_kv_cache(
    config: EngineConfig,
    source: ModelSource,
    capture: GraphCapture,
    max_model_len: int,
    graph_reserve: int,
    draft_bytes_per_block: int = 0,
) -> int:
    """The KV cache sized beside the measured graph memory; with a fixed KV budget, the
    capture ladder cut to the memory left instead."""
    runner, dtype, kv = capture.runner, torch_dtype(config), kv_dtype(config)
    # a hybrid's state entries beyond one slot per sequence: checkpoints, per-position states
    checkpoints = runner.states.num_checkpoints + runner.states.position_rows
    num_blocks = size_kv_cache(
        config.cache, source.config, dtype, runner.device, max_model_len,
        config.scheduler.max_num_seqs, graph_reserve, checkpoints, draft_bytes_per_block, kv,
    )  # fmt: skip
    runner.allocate_kv_cache(num_blocks, dtype, kv)
    if config.cache.kv_cache_prefault and runner.device.type == "cpu":
        tensors = [t for pair in runner.kv_caches for t in pair]
        seconds = fault_in(tensors)
        size = sum(t.untyped_storage().nbytes() for t in tensors) / 2**30
        logger.info("KV cache: %.2f GiB faulted in at boot in %.1f s", size, seconds)
    if config.cache.kv_cache_memory is not None:
        capture.fit_beside_fixed_kv(available_memory(runner.device), config.strict_graphs)
    return num_blocks


def _report(
    source: ModelSource, runner: ModelRunner, entry: CompileCacheEntry | None
) -> BootReport:
    return BootReport(
        model_path=source.path,
        device=runner.device,
        attention_backend=runner.attn_backend.name,
        attention_graph_support=runner.attn_backend.graph_support.value,
        attention_kernels=runner.attn_backend.describe(),
        compile_cache=entry,
    )


def _seal(entry: CompileCacheEntry | None, runner: ModelRunner) -> None:
    """What mode 3 compiled at warm-up is complete: the entry is sealed for later boots."""
    if entry is None:
        return
    entry.seal()
    stats = runner.compile_backend.stats
    reused = "reused" if entry.reused else "new"
    logger.info("torch.compile: %s (compile cache %s)", stats.summary(runner.plan.backend), reused)


def warm_up(engine: LLMEngine, runner: ModelRunner) -> None:
    """A prefill step then a decode step, so compilation happens at boot, not on the first
    request; afterwards every recompilation is counted and warned about."""
    n = max(1, min(8, engine.max_model_len - 3))
    spec = engine.config.speculative
    # with speculation, long enough for a verification step (and the draft model's steps):
    # a prompt of one repeated token is what n-gram lookups find
    extra = spec.num_speculative_tokens + 1 if spec is not None else 0
    params = SamplingParams(temperature=0, max_tokens=2 + extra, ignore_eos=True)
    engine.add_request(WARM_UP_REQUEST, [1] * n, params)
    engine.step()
    _check_trace_saved(engine.config, runner)
    runner.mark_warmed_up()
    while engine.has_unfinished_requests():
        engine.step()
    engine.forget_warm_up()


def _check_trace_saved(config: EngineConfig, runner: ModelRunner) -> None:
    """A trace that `aot_compile` could not save changes what later boots do: with
    --strict-graphs an error, before the compile cache entry is sealed without it."""
    backend = runner.compile_backend
    error = backend.stats.trace_error if backend is not None else None
    if error and config.strict_graphs:
        raise ConfigError(
            f'--strict-graphs: "aot_compile" is on, but Dynamo\'s trace of the forward '
            f"could not be saved ({error}), so every boot would trace it again. Remedy: "
            'set "aot_compile": false, or drop --strict-graphs'
        )
