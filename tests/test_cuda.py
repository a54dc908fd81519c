"""CUDA checks (skipped without a GPU): the engine on a CUDA device, eager and compiled, against
HF transformers on the same device. CUDA-graph capture is not built yet: the plan must say so
loudly (a warning per change) rather than silently run eager."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln import SamplingParams
from kiln.compilation import CompilationConfig, CUDAGraphMode
from kiln.config import CacheConfig, EngineConfig, SchedulerConfig
from kiln.engine import LLMEngine
from tests.helpers import run_schedule

pytestmark = pytest.mark.cuda


def _engine(path: str, dtype: str, compilation: CompilationConfig) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=path,
            dtype=dtype,
            device="cuda",
            cache=CacheConfig(block_size=16, kv_cache_memory=256 * 2**20),
            scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
            compilation=compilation,
        )
    )


@pytest.mark.parametrize("mode", [0, 3])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_cuda_logits_match_hf(tiny_models, name, mode):
    engine = _engine(tiny_models[name], "float32", CompilationConfig(mode=mode))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 49000, (n,), generator=g).tolist() for n in (5, 40, 17)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    finals, logits = run_schedule(
        engine, [(i, p, params) for i, p in enumerate(prompts)], record_logits=True
    )
    hf = AutoModelForCausalLM.from_pretrained(tiny_models[name]).cuda().eval()
    for rid, out in finals.items():
        prompt = prompts[int(rid)]
        ids = torch.tensor([prompt + out.outputs[0].token_ids], device="cuda")
        with torch.no_grad():
            ref = hf(ids).logits[0, len(prompt) - 1 : -1]
        ours = torch.stack(logits[rid])
        torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())
    assert engine.stats().graphs["recompilations"] == 0


def test_cuda_graph_modes_are_refused_loudly(tiny_models, caplog):
    with caplog.at_level(logging.WARNING):
        engine = _engine(
            tiny_models["llama"],
            "bfloat16",
            CompilationConfig(mode=3, cudagraph_mode=CUDAGraphMode.FULL),
        )
    assert engine.plan.cudagraph_mode is CUDAGraphMode.NONE
    assert any("not implemented" in r.getMessage() for r in caplog.records)
