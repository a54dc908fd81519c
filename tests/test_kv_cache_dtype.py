"""--kv-cache-dtype: a float32 model over a bfloat16 KV cache. The cache holds twice the tokens
of a budget; the logits stay within the keys' bf16 rounding of HF transformers' float32 ones;
a prefix hit (keys read back from the cache) gives what recomputing the prefix gives, since a
chunk attends its own keys rounded as the cache keeps them. The attention ops themselves are
checked against attention by hand in test_cpu_backend.py and test_triton_backend.py."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import ConfigError
from kiln.sampling_params import SamplingParams
from tests.helpers import make_engine
from tests.test_parity import _hf_logits, _prompts, _run


def test_a_bfloat16_cache_holds_twice_the_blocks_of_a_budget(tiny_models):
    budget = 2**18  # less than the scheduler could use either way, so the budget decides
    f32 = make_engine(tiny_models["llama"], kv_cache_memory=budget, max_model_len=128)
    bf16 = make_engine(tiny_models["llama"], kv_cache_memory=budget, max_model_len=128,
                       kv_cache_dtype="bfloat16")  # fmt: skip
    assert f32.runner.kv_caches[0][0].dtype == torch.float32
    assert bf16.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert abs(bf16.blocks.num_blocks - 2 * f32.blocks.num_blocks) <= 1


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])  # qwen3_next: float32 state slots
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_logits_over_a_bfloat16_cache_stay_near_hf(tiny_models, hf_models, name, backend):
    """Chunked prefill, prefix hits and mixed batches as test_parity runs them. Tolerance: keys
    and values rounded to bf16 (relative 2^-9) moved the logits by at most 1.3e-3 of their
    scale here (float32 caches: 1e-4); 5e-3 leaves 4x, and a misread cache (bf16 bits taken
    for float32, a wrong slot) is off by the scale itself."""
    engine = make_engine(tiny_models[name], max_num_batched_tokens=24, kv_cache_dtype="bfloat16",
                         attention_backend=backend)  # fmt: skip
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    prompts = _prompts()
    finals, logits = _run(engine, prompts)
    for rid, out in finals.items():
        ref = _hf_logits(hf_models[name], prompts[int(rid)], out.outputs[0].token_ids)
        ours = torch.stack(logits[rid])
        assert ours.dtype == torch.float32
        scale = ref.abs().max().item()
        torch.testing.assert_close(ours, ref, rtol=0, atol=5e-3 * scale)


def test_a_prefix_hit_over_a_bfloat16_cache_gives_the_recomputed_output(tiny_models):
    """The same 40-token prompt twice: the second reads 32 tokens of keys from the cache (a
    prefix hit), the first computed them in its own chunks; greedy tokens are the same."""
    engine = make_engine(tiny_models["llama"], max_num_batched_tokens=16,
                         kv_cache_dtype="bfloat16")  # fmt: skip
    prompt = _prompts()[2]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = []
    for i in range(2):
        engine.add_request(str(i), prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs.append(out)
    assert outputs[0].num_cached_tokens == 0 and outputs[1].num_cached_tokens >= 32
    assert outputs[1].outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_an_unknown_kv_cache_dtype_names_the_choices():
    from kiln.config.engine import CacheConfig

    with pytest.raises(ConfigError, match="choose auto or one of"):
        CacheConfig(kv_cache_dtype="fp8")
