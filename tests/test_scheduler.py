"""Continuous batching under pressure: preemption by recompute, prefix-cache hits, no leaks."""

from __future__ import annotations

import torch

from kiln import SamplingParams
from tests.helpers import make_engine, run_schedule


def _prompts(n: int, length: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49000, (length + 7 * i,), generator=g).tolist() for i in range(n)]


def test_preemption_gives_identical_outputs(tiny_models):
    model = tiny_models["qwen3"]
    prompts = _prompts(8, 30)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True)
    arrivals = [(i, p, greedy if i % 2 else seeded) for i, p in enumerate(prompts)]
    roomy, _ = run_schedule(make_engine(model, block_size=4), arrivals)

    # 48 blocks of 4 tokens (2 KiB each): room for about two sequences, so blocks run out
    # mid-decode
    tight = make_engine(model, block_size=4, max_model_len=160, kv_cache_memory=48 * 2048)
    assert tight.stats().num_blocks == 48
    tight_out, _ = run_schedule(tight, arrivals)
    stats = tight.stats()
    assert stats.num_preemptions > 0
    for rid, out in roomy.items():
        assert tight_out[rid].outputs[0].token_ids == out.outputs[0].token_ids
    assert stats.num_free_blocks == stats.num_blocks
    assert not tight.scheduler.running and not tight.scheduler.waiting


def test_prefix_cache_hits_are_counted_and_correct(tiny_models):
    engine = make_engine(tiny_models["llama"], block_size=16)
    prompt = _prompts(1, 50)[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first, _ = run_schedule(engine, [(0, prompt, params)])
    second, _ = run_schedule(engine, [(0, prompt, params)])
    assert first["0"].num_cached_tokens == 0
    assert second["0"].num_cached_tokens == 48  # three full blocks of the 50-token prompt
    assert second["0"].outputs[0].token_ids == first["0"].outputs[0].token_ids
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens == 48
    assert stats.num_free_blocks == stats.num_blocks


def test_prefix_cache_off_never_hits(tiny_models):
    engine = make_engine(tiny_models["llama"], prefix_caching=False)
    prompt = _prompts(1, 50)[0]
    params = SamplingParams(temperature=0, max_tokens=4)
    run_schedule(engine, [(0, prompt, params)])
    again, _ = run_schedule(engine, [(0, prompt, params)])
    assert again["0"].num_cached_tokens == 0


def test_max_num_seqs_bounds_the_batch(tiny_models):
    engine = make_engine(tiny_models["llama"], max_num_seqs=3)
    sizes = []
    original = engine.runner.prepare
    engine.runner.prepare = lambda batch: (sizes.append(len(batch)), original(batch))[1]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs, _ = run_schedule(engine, [(0, p, params) for p in _prompts(7, 10)])
    assert len(outs) == 7 and max(sizes) == 3


def test_abort_frees_blocks(tiny_models):
    engine = make_engine(tiny_models["llama"])
    engine.add_request("a", _prompts(1, 40)[0], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().num_free_blocks < engine.stats().num_blocks
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    assert not engine.has_unfinished_requests()


def test_kv_budget_below_one_context_is_a_clear_error(tiny_models):
    import pytest

    from kiln import ConfigError

    with pytest.raises(ConfigError, match=r"raise --kv-cache-memory .* or lower --max-model-len"):
        make_engine(tiny_models["llama"], block_size=4, kv_cache_memory=10 * 2048)


def test_token_budget_defaults_per_device(smollm_path):
    """Left out, the step's token budget (the prefill chunk) is 512 on the CPU, where a chunk
    stalls every running decode for as long as it runs, and 2048 on CUDA; given, it is kept."""
    from kiln import LLM
    from kiln.config.engine import SchedulerConfig

    assert SchedulerConfig().for_device("cpu").max_num_batched_tokens == 512
    assert SchedulerConfig().for_device("cuda").max_num_batched_tokens == 2048
    given = SchedulerConfig(max_num_batched_tokens=96)
    assert given.for_device("cpu") is given
    llm = LLM(kv_cache_memory="96MiB", device="cpu", max_model_len=2048, max_num_seqs=1)
    assert llm.engine.config.scheduler.max_num_batched_tokens == 512
    prompt = {"prompt_token_ids": list(range(5, 1205))}
    llm.generate(prompt, SamplingParams(max_tokens=1))
    assert llm.engine.num_steps == 3  # 1200 prompt tokens in chunks of 512


def test_block_size_defaults_per_device(smollm_path):
    """Left out, a KV block is 64 tokens on the CPU (its kernels read blocks in table order)
    and 16 on CUDA; given, it is kept. Prefix hits then come in whole 64-token blocks."""
    from kiln import LLM
    from kiln.config.engine import CacheConfig

    assert CacheConfig().for_device("cpu").block_size == 64
    assert CacheConfig().for_device("cuda").block_size == 16
    given = CacheConfig(block_size=8)
    assert given.for_device("cpu") is given
    llm = LLM(kv_cache_memory="96MiB", device="cpu", max_model_len=2048, max_num_seqs=1)
    assert llm.engine.config.cache.block_size == 64
    shared = list(range(5, 205))  # 200 tokens: three whole blocks of 64
    params = SamplingParams(max_tokens=1)
    llm.generate({"prompt_token_ids": [*shared, 7]}, params)
    (out,) = llm.generate({"prompt_token_ids": [*shared, 9, 11]}, params)
    assert out.num_cached_tokens == 192
