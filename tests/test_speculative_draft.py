"""Speculative decoding with a draft model: the embedded model drafting for itself accepts every
draft (greedy and sampled) and changes no token; another model's drafts change no greedy token
either, under preemption too; the two KV caches share one budget and give every block back;
the drafter's steps go through its own graph plan with zero misses; a draft model with another
vocabulary is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kiln import SamplingParams, build_engine
from kiln.config.speculative import SpeculativeConfig
from kiln.cudagraphs.graph_backend import EmulatedGraphBackend
from kiln.default_model import default_model_path
from kiln.errors import ConfigError
from tests.helpers import make_engine, run_schedule
from tests.test_speculative import _tiny_workload


def _draft(config, model: str, k: int = 3):
    return replace(config, speculative=SpeculativeConfig("draft_model", k, model=model))


def _free_everything(engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_the_embedded_model_drafting_for_itself_accepts_everything(smollm_dense_llm):
    reference = smollm_dense_llm.engine
    cache = reference.config.cache
    doubled = replace(cache, kv_cache_memory=2 * cache.kv_cache_memory)
    engine = build_engine(_draft(replace(reference.config, cache=doubled), default_model_path()))
    # the same model's KV twice, from twice the budget: as many blocks as the reference
    assert engine.blocks.num_blocks == reference.blocks.num_blocks
    ids = [reference.tokenizer.encode(p) for p in ("The capital of France is", "def f(x):")]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    arrivals = [(0, ids[0], greedy), (1, ids[1], greedy)]
    want, _ = run_schedule(reference, arrivals)
    got, _ = run_schedule(engine, arrivals)
    for rid in want:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids
    st = engine.stats().spec_decode
    assert st["num_draft_tokens"] > 20 and st["acceptance_rate"] == 1.0
    assert engine.num_steps < reference.num_steps
    sampled = SamplingParams(temperature=0.9, top_k=50, max_tokens=30, ignore_eos=True, seed=4)
    run_schedule(engine, [(0, ids[0], sampled)])
    st = engine.stats().spec_decode  # p == q: min(1, p/q) accepts every draft
    assert st["acceptance_rate"] == 1.0
    _free_everything(engine)


@pytest.mark.parametrize(("kv", "mode"), [(2**20, 0), (72 * 512, 0), (2**20, 3)],
                         ids=["roomy", "preempting", "mode3"])  # fmt: skip
def test_another_models_drafts_change_no_greedy_token(tiny_models, kv, mode):
    from kiln.config import CompilationConfig

    kwargs = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=8, kv_cache_memory=kv,
                  max_model_len=64, compilation=CompilationConfig(mode=mode))  # fmt: skip
    reference = make_engine(tiny_models["llama"], **kwargs)
    want, _ = run_schedule(reference, _tiny_workload())
    cache = replace(reference.config.cache, kv_cache_memory=2 * kv)  # its KV has the same shape
    config = _draft(replace(reference.config, cache=cache), tiny_models["qwen3"])
    spec = replace(config.speculative, disable_by_batch_size=8)
    engine = build_engine(replace(config, speculative=spec))
    got, _ = run_schedule(engine, _tiny_workload())
    for rid in want:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
    st = engine.stats()
    assert st.spec_decode["num_drafts"] > 0
    assert st.spec_decode["num_accepted_tokens"] < st.spec_decode["num_draft_tokens"]
    if kv < 2**20:
        assert st.num_preemptions > 0
    _free_everything(engine)


def test_the_drafter_follows_its_own_graph_plan_without_misses(tiny_models):
    """FULL_DECODE_ONLY on the emulated backend (Triton attention): the target verifies in FULL
    graphs of 4 tokens per sequence, the drafter decodes in FULL graphs of 1."""
    from tests.test_graphs import PREEMPTING, _engine, _workload

    base = _engine(tiny_models["llama"], "FULL_DECODE_ONLY", 0, "triton", kv=2 * PREEMPTING)
    config = _draft(base.config, tiny_models["llama_tied_llama3rope"])
    base.close()
    engine = build_engine(config, graph_backend=EmulatedGraphBackend())
    run_schedule(engine, _workload())
    st = engine.stats()
    assert st.graphs["graph_misses"] == 0 and st.graphs["steps"]["FULL"] > 0
    drafter = st.spec_decode["draft_graphs"]
    assert drafter["graph_misses"] == 0 and drafter["steps"]["FULL"] > 0
    _free_everything(engine)


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_models, tmp_path):
    import transformers

    from tests.conftest import TINY

    other = transformers.LlamaConfig(vocab_size=1000, **TINY)
    transformers.AutoModelForCausalLM.from_config(other).save_pretrained(tmp_path)
    config = _draft(make_engine(tiny_models["llama"]).config, str(tmp_path))
    with pytest.raises(ConfigError, match="vocabulary of 1000 tokens"):
        build_engine(config)
