"""--kv-cache-dtype: a float32 model over a bfloat16 or int8 KV cache. The cache holds twice
(bf16) or about 3.8x (int8, head dim 64) the tokens of a budget; the logits stay within the
keys' rounding of HF transformers' float32 ones; a prefix hit (keys read back from the cache)
gives what recomputing the prefix gives, since a chunk attends its own keys rounded as the
cache keeps them. The attention ops themselves are checked against attention by hand in
test_cpu_backend.py and test_triton_backend.py."""

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
    int8 = make_engine(tiny_models["llama"], kv_cache_memory=budget, max_model_len=128,
                       kv_cache_dtype="int8")  # fmt: skip
    cache = int8.runner.kv_caches[0][0]
    head_dim = int8.runner.model.config.head_dim
    assert cache.dtype == torch.int8 and cache.shape[-1] == head_dim + 4  # values, then scale
    want = 4 * head_dim / (head_dim + 4) * f32.blocks.num_blocks
    assert abs(int8.blocks.num_blocks - want) <= 1


# relative to the logits' scale: keys and values rounded to bf16 (relative 2^-9) moved the
# logits by at most 1.3e-3 here, int8 ones (half a step of max|x| / 127) by at most 2.3e-3 on
# an AVX2 CPU and 4.5e-3 on an AVX-512 one, the cpu and torch backends alike (float32 caches:
# 1e-4); the tolerances leave 2-4x, and a misread cache (bf16 bits taken
# for float32, a scale read from the wrong bytes, a wrong slot) is off by the scale itself
CACHE_TOLERANCE = {"bfloat16": 5e-3, "int8": 1e-2}


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])  # qwen3_next: float32 state slots
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_logits_over_a_narrower_cache_stay_near_hf(tiny_models, hf_models, name, backend,
                                                    kv_dtype):  # fmt: skip
    """Chunked prefill, prefix hits and mixed batches as test_parity runs them, over a bf16 or
    an int8 cache (CACHE_TOLERANCE)."""
    engine = make_engine(tiny_models[name], max_num_batched_tokens=24, kv_cache_dtype=kv_dtype,
                         attention_backend=backend)  # fmt: skip
    assert engine.runner.kv_caches[0][0].dtype == getattr(torch, kv_dtype)
    prompts = _prompts()
    finals, logits = _run(engine, prompts)
    for rid, out in finals.items():
        ref = _hf_logits(hf_models[name], prompts[int(rid)], out.outputs[0].token_ids)
        ours = torch.stack(logits[rid])
        assert ours.dtype == torch.float32
        scale = ref.abs().max().item()
        torch.testing.assert_close(ours, ref, rtol=0, atol=CACHE_TOLERANCE[kv_dtype] * scale)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_a_prefix_hit_over_a_narrower_cache_gives_the_recomputed_output(tiny_models, kv_dtype):
    """The same 40-token prompt twice: the second reads 32 tokens of keys from the cache (a
    prefix hit), the first computed them in its own chunks; greedy tokens are the same."""
    engine = make_engine(tiny_models["llama"], max_num_batched_tokens=16,
                         kv_cache_dtype=kv_dtype)  # fmt: skip
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

    with pytest.raises(ConfigError, match="choose auto, int8 or one of"):
        CacheConfig(kv_cache_dtype="fp8")


def test_an_int8_cache_with_the_triton_backend_is_refused_with_the_remedy():
    from kiln.attention.backend import AttentionShape
    from kiln.attention.selector import select_backend

    shape = AttentionShape(4, 2, 16)
    with pytest.raises(ConfigError, match=r"no int8 path.*--kv-cache-dtype bfloat16"):
        select_backend("triton", torch.device("cpu"), 16, shape, torch.float32, torch.int8)


def test_the_embedded_model_over_an_int8_cache_answers_the_shipped_probes(smollm_path):
    """The packed embedded model's own probes (France -> Paris leads its runner-up by only 0.08
    of a logit) with every key and value read back from int8, greedy, as the benchmark asks."""
    from kiln import LLM
    from kiln.bench.probes import answer_passes, probe_messages
    from kiln.profiles import load_profile

    probes = load_profile("smollm2-baseline").probes
    with LLM(kv_cache_memory="512MiB", kv_cache_dtype="int8") as llm:
        assert llm.engine.runner.kv_caches[0][0].dtype == torch.int8
        for probe in probes:
            params = SamplingParams(temperature=0, max_tokens=probe.max_tokens)
            answer = llm.chat(probe_messages(probe), params)[0].outputs[0].text
            assert answer_passes(answer, probe.expect), (probe.prompt, answer)
