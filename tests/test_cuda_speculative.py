"""Speculative decoding with real CUDA graphs (skipped without a GPU): n-gram verification
batches of 1 + k tokens per sequence replay FULL decode graphs of the Triton backend, greedy
tokens equal eager without speculation on the mixed workload with preemption, a steady
speculative decode has zero graph misses, and a hybrid's MTP head drafts in graphs of its own."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kiln import SamplingParams, build_engine
from kiln.config import CompilationConfig
from kiln.config.speculative import SpeculativeConfig
from kiln.engine.llm_engine import LLMEngine
from tests.helpers import run_schedule
from tests.test_cuda import PREEMPTING, SIZES, _engine, _workload

pytestmark = pytest.mark.cuda

SPEC = SpeculativeConfig("ngram", 3, 1, 3, disable_by_batch_size=8)


def _speculating(path: str, graph_mode: str, kv: int | None = PREEMPTING) -> LLMEngine:
    mode = 3 if "PIECEWISE" in graph_mode else 0
    config = CompilationConfig(mode=mode, cudagraph_mode=graph_mode, cudagraph_capture_sizes=SIZES)
    base = _engine(path, "float32", config, kv=kv, max_model_len=128)
    spec_config = replace(base.config, speculative=SPEC)
    base.close()
    return build_engine(spec_config)


@pytest.mark.parametrize("graph_mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_cuda_speculative_graphs_equal_eager(tiny_models, graph_mode):
    path = tiny_models["llama"]
    eager = _engine(path, "float32", CompilationConfig(mode=0, cudagraph_mode="NONE"),
                    kv=PREEMPTING, max_model_len=128)  # fmt: skip
    want, _ = run_schedule(eager, _workload())
    eager.close()
    engine = _speculating(path, graph_mode)
    assert engine.plan.uniform_decode_query_len == 4
    st = _speculated_as_plain(engine, want)
    assert st.graphs["steps"]["FULL"] > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_cuda_steady_speculative_decode_has_no_graph_misses(tiny_models):
    engine = _speculating(tiny_models["llama"], "FULL_DECODE_ONLY", kv=None)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    run_schedule(engine, [(0, [5 + i, 6 + i] * 4, params) for i in range(6)])
    st = engine.stats()
    assert st.graphs["graph_misses"] == 0 and st.graphs["steps"]["FULL"] >= 8
    assert st.spec_decode["num_draft_tokens"] >= 8 * 3


@pytest.mark.parametrize("graph_mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_cuda_mtp_head_in_graphs_equals_eager(mtp_models, graph_mode):
    """The tiny Qwen3-Next with an MTP head: the target verifies runs of 1 + k tokens through
    its Gated DeltaNet state, the head catches up and chains in its own graphs; greedy tokens
    equal eager without speculation, zero misses for the target and the head."""
    path = mtp_models["qwen3_next"]
    eager = _engine(path, "float32", CompilationConfig(mode=0, cudagraph_mode="NONE"),
                    max_model_len=128)  # fmt: skip
    want, _ = run_schedule(eager, _workload())
    eager.close()
    mode = 3 if "PIECEWISE" in graph_mode else 0
    config = CompilationConfig(mode=mode, cudagraph_mode=graph_mode, cudagraph_capture_sizes=SIZES)
    base = _engine(path, "float32", config, max_model_len=128)
    mtp = SpeculativeConfig("mtp", 2, disable_by_batch_size=8)
    spec_config = replace(base.config, speculative=mtp)
    base.close()
    engine = build_engine(spec_config)
    st = _speculated_as_plain(engine, want)
    head = st.spec_decode["draft_graphs"]
    assert head["graph_misses"] == 0 and head["steps"]["FULL"] > 0, head
    engine.close()


def _speculated_as_plain(engine, want: dict):
    """The workload on a speculating engine: every request's tokens as without speculation,
    drafts verified, no graph miss; its stats."""
    got, _ = run_schedule(engine, _workload())
    for rid in want:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
    st = engine.stats()
    assert st.spec_decode["num_drafts"] > 0
    assert st.graphs["graph_misses"] == 0, st.graphs["graph_miss_examples"]
    return st
