"""Drivers shared by tests: run the real engine on a scripted arrival schedule and record the
logits each sampled token came from."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from collections import defaultdict
from types import ModuleType

import torch

from kiln import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig, build_engine
from kiln.config import CompilationConfig


def make_engine(
    model: str | None,
    block_size: int = 16,
    prefix_caching: bool = True,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 16,
    kv_cache_memory: int = 64 * 2**20,
    max_model_len: int | None = None,
    compilation: CompilationConfig | None = None,
    attention_backend: str = "auto",
    graph_backend=None,
    dtype: str = "float32",
    strict_graphs: bool = False,
    quantization: str = "auto",
    tokenizer: str | None = None,
    prefill_weights: str = "auto",
    speculative=None,
    kv_cache_dtype: str = "auto",
    cpu_linears: str = "auto",
) -> LLMEngine:
    return build_engine(
        EngineConfig(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            quantization=quantization,
            prefill_weights=prefill_weights,
            cpu_linears=cpu_linears,
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory=kv_cache_memory,
                enable_prefix_caching=prefix_caching,
                kv_cache_dtype=kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
            ),
            compilation=compilation or CompilationConfig(),
            attention_backend=attention_backend,
            strict_graphs=strict_graphs,
            speculative=speculative,
        ),
        graph_backend=graph_backend,
    )


def forward_with_int32_positions(engine: LLMEngine) -> None:
    """One compiled forward of a new request, laid out as a step lays it out but with int32
    positions (kiln passes int64): a guard of the compiled forward fails on it."""
    engine.add_request("int32", [5, 6, 7], SamplingParams(max_tokens=1))
    batch = engine.scheduler.schedule()
    runner = engine.runner
    with torch.inference_mode():
        input_ids, positions, meta = runner.model_inputs(runner.prepare(batch).layout)
        runner.forward(input_ids, positions.to(torch.int32), meta)


def run_schedule(
    engine: LLMEngine,
    arrivals: list[tuple[int, list[int], SamplingParams]],
    record_logits: bool = False,
):
    """arrivals: (step at which the request arrives, prompt ids, params). Returns
    {request_id: final RequestOutput} and, if asked, {request_id: [logits per token]}."""
    logits: dict[str, list[torch.Tensor]] = defaultdict(list)
    if record_logits:

        def observe(seqs, rows):
            for seq, row in zip(seqs, rows):
                logits[seq.request_id].append(row.clone())

        engine.runner.logits_observer = observe
    finals, step, pending = {}, 0, sorted(enumerate(arrivals), key=lambda a: a[1][0])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            engine.add_request(str(i), prompt, params)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
    engine.runner.logits_observer = None
    return finals, logits


def load_benchmark(name: str) -> ModuleType:
    """A script of benchmarks/ (not a package) as a module."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # what dataclasses look their module up in
    spec.loader.exec_module(module)
    return module


def add_mtp_head(source: str, path: str, seed: int = 1) -> str:
    """A copy of a hybrid checkpoint with a random multi-token-prediction head, named as
    Qwen3-Next and Qwen3.5 ship theirs: `mtp.fc` [H, 2H], the two pre-fc norms, one decoder
    layer shaped as the checkpoint's first full-attention layer (experts where it has them)
    and a final norm."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, path)
    with open(os.path.join(path, "config.json")) as f:
        layer_types = json.load(f)["layer_types"]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    attention_layer = f"model.layers.{layer_types.index('full_attention')}."
    mtp = {}
    for name, t in tensors.items():
        if name.startswith(attention_layer):
            scale = 0.1 if t.dim() == 1 else 0.05  # norms: offsets from one; weights: HF's init
            mtp["mtp.layers.0." + name.removeprefix(attention_layer)] = (
                torch.randn(t.shape, generator=g, dtype=torch.float32) * scale
            ).to(t.dtype)
    h = tensors["model.embed_tokens.weight"].shape[1]
    dtype = tensors["model.embed_tokens.weight"].dtype
    mtp["mtp.fc.weight"] = (torch.randn(h, 2 * h, generator=g) * 0.05).to(dtype)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = (torch.randn(h, generator=g) * 0.1).to(dtype)
    save_file({**tensors, **mtp}, os.path.join(path, "model.safetensors"))
    return path


def assert_grouped_calls_equal_calls_alone(builds: list, weights: list, stack_type: type) -> None:
    """A step's experts in one call on each vector build of a Q6_K or K-quant kernel (`builds`:
    (name, kernel) pairs; the portable one is skipped): each group's rows get exactly what that
    expert's own product gives, with one or two planes, one group past the AVX2 path's tile of
    16 rows; rows of no group are zeros. `weights`: three experts' packed weights."""
    from kiln.layers.expert_groups import ExpertGroups

    stack = stack_type(*(torch.stack([getattr(w, f) for w in weights])
                         for f in stack_type.__dataclass_fields__))  # fmt: skip
    groups = ExpertGroups(experts=[2, 0], starts=[0, 5], counts=[5, 18])
    x = torch.randn(24, weights[0].low.shape[1] * 2)  # low: [N, K / 2] in both layouts
    for name, kernel in builds:
        if name == "portable":
            continue
        for planes in (1, 2):
            got = kernel.matmul_experts(x, stack, groups, torch.float32, planes)
            for e, start, count in zip(groups.experts, groups.starts, groups.counts, strict=True):
                alone = kernel.matmul(x[start : start + count], weights[e], torch.float32, planes)
                assert torch.equal(got[start : start + count], alone)
            assert not got[23].any()


def kernel_builds(load, engine_kernel) -> list:
    """(name, kernel) for a Q6_K or K-quant kernel (`load(flags)`, `engine_kernel()`): the
    portable loops, the AVX2 path (the path of CPUs without AVX512-VNNI and VBMI) where this CPU
    runs it, and the engine's build where it has a vector path."""
    from kiln.native import AVX2_FLAGS, PORTABLE_FLAGS, runs_avx2

    out = [("portable", load(PORTABLE_FLAGS))]
    if runs_avx2():
        out.append(("avx2", load(AVX2_FLAGS)))
    if engine_kernel() is not None:
        out.append(("native", engine_kernel()))
    return out
