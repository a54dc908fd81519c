"""Hybrid models (Qwen3-Next: Gated DeltaNet layers beside attention layers) in the engine:
state slots taken and given back with a sequence's blocks (preemption and abort leak none, and
a preempted sequence recomputed into a fresh slot gives the same tokens), the state memory
sized beside the KV cache, what the boot turns off said loudly. HF parity is in test_parity.py,
the delta rule in test_gdn.py."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln import SamplingParams
from kiln.boot.kv_cache import state_bytes_per_sequence
from kiln.config import CompilationConfig
from kiln.engine.state_slots import StateSlots
from kiln.errors import ConfigError
from kiln.loader import open_model
from tests.helpers import make_engine, run_schedule


def _workload():
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49000, (n,), generator=g).tolist() for n in (7, 30, 12, 45, 3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [(t, p, params) for t, p in zip([0, 0, 1, 2, 4], prompts)]


def test_preempted_sequences_recompute_into_fresh_slots(tiny_models):
    """A KV budget that forces preemption: the same greedy tokens as with room for all, and
    every slot free at the end."""
    path = tiny_models["qwen3_next"]
    roomy = make_engine(path, block_size=4, max_num_batched_tokens=16, prefix_caching=False)
    tight = make_engine(path, block_size=4, max_num_batched_tokens=16, prefix_caching=False,
                        kv_cache_memory=_kv_bytes(path, 64) + _state_bytes(path, 16),
                        max_model_len=64)  # fmt: skip
    expected, _ = run_schedule(roomy, _workload())
    got, _ = run_schedule(tight, _workload())
    assert tight.stats().num_preemptions > 0
    for rid, out in expected.items():
        assert got[rid].outputs[0].token_ids == out.outputs[0].token_ids
    for engine in (roomy, tight):
        slots = engine.blocks.state_slots
        assert slots.num_free == slots.num_slots == 16


def _kv_bytes(path: str, tokens: int) -> int:
    cfg = open_model(path).config
    return tokens * len(cfg.attention_layer_ids) * 2 * cfg.num_kv_heads * cfg.head_dim * 4


def _state_bytes(path: str, seqs: int) -> int:
    return seqs * state_bytes_per_sequence(open_model(path).config, torch.float32)


def test_the_state_bytes_are_the_layers_state_shapes(tiny_models):
    cfg = open_model(tiny_models["qwen3_next"]).config
    la = cfg.linear_attention
    conv = (2 * 2 * 16 + 4 * 8) * (4 - 1) * 4  # (q, k, v channels) x (kernel - 1) x fp32
    recurrent = 4 * 16 * 8 * 4  # value heads x key dim x value dim x fp32
    assert la.state_bytes(torch.float32) == conv + recurrent
    assert state_bytes_per_sequence(cfg, torch.float32) == len(cfg.linear_layer_ids) * (
        conv + recurrent
    )
    assert cfg.linear_layer_ids == (0,) and cfg.attention_layer_ids == (1,)


def test_an_abort_gives_the_slot_back(tiny_models):
    engine = make_engine(tiny_models["qwen3_next"], prefix_caching=False, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, [5, 6, 7, 8], params)
    engine.step()
    slots = engine.blocks.state_slots
    assert slots.num_free == 0 and len(engine.scheduler.waiting) == 1  # c waits for a slot
    engine.abort_request("a")
    assert slots.num_free == 1
    engine.step()  # c takes a's slot and starts from an empty state
    assert slots.num_free == 0
    for rid in ("b", "c"):
        engine.abort_request(rid)
    assert slots.num_free == 2


def test_slots_refuse_a_double_give_back():
    slots = StateSlots(2)
    a = slots.take()
    slots.give_back(a)
    with pytest.raises(RuntimeError, match="given back twice"):
        slots.give_back(a)


def test_what_a_hybrid_model_cannot_do_yet_is_turned_off_loudly(tiny_models, caplog):
    path = tiny_models["qwen3_next"]
    compiled = CompilationConfig(mode=3, cudagraph_mode="NONE")
    with caplog.at_level(logging.WARNING, logger="kiln.boot.preview"):
        engine = make_engine(path, compilation=compiled)
    assert engine.plan.mode == 0 and not engine.config.cache.enable_prefix_caching
    warnings = [r.getMessage() for r in caplog.records]
    assert any("prefix caching is off" in w and "--no-enable-prefix-caching" in w for w in warnings)
    assert any("torch.compile and CUDA graphs are off" in w for w in warnings)
    with pytest.raises(ConfigError, match="strict-graphs"):
        make_engine(path, compilation=compiled, prefix_caching=False, strict_graphs=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kiln.boot.preview"):
        make_engine(path, prefix_caching=False)  # what it can do: nothing to say
    assert not caplog.records
