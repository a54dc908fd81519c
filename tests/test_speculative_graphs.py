"""Speculative decoding through the graph plan, on the CPU's emulated graph backend: the
verification steps take the plan's graphs (FULL decode graphs of 1 + k tokens per sequence for
the Triton backend, whose kernel writes and reads keys in one launch; decode rows of one
position each, in PIECEWISE graphs, for the torch backend), with zero graph misses on the mixed
workload with preemption, and greedy tokens equal to eager without speculation. The same
checks on a GPU are in test_cuda.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kiln import build_engine
from kiln.config.speculative import SpeculativeConfig
from kiln.cudagraphs.graph_backend import EmulatedGraphBackend
from tests.helpers import run_schedule
from tests.test_graphs import PREEMPTING, _engine, _workload

pytest.importorskip("triton")

SPEC = SpeculativeConfig("ngram", 3, 1, 3, disable_by_batch_size=8)

# (cudagraph mode, compilation mode, attention backend, tokens per row of a verification)
MODES = [
    ("FULL_DECODE_ONLY", 0, "triton", 4),
    ("FULL_AND_PIECEWISE", 3, "triton", 4),
    ("PIECEWISE", 3, "torch", 1),
]


@pytest.fixture(scope="module")
def eager_tokens(tiny_models):
    """Greedy tokens per request, eager and without speculation, per attention backend."""
    out = {}
    for backend in ("torch", "triton"):
        engine = _engine(tiny_models["llama"], "NONE", 0, backend, graphs=False, kv=PREEMPTING)
        finals, _ = run_schedule(engine, _workload())
        out[backend] = {rid: f.outputs[0].token_ids for rid, f in finals.items()}
    return out


@pytest.mark.parametrize(("graph_mode", "mode", "backend", "row_tokens"), MODES)
def test_verification_runs_in_graphs_without_misses(
    tiny_models, eager_tokens, graph_mode, mode, backend, row_tokens
):
    # less KV than the eager runs: drafts take step budget, so fewer sequences run at once
    base = _engine(tiny_models["llama"], graph_mode, mode, backend, kv=PREEMPTING * 3 // 4)
    config = replace(base.config, speculative=SPEC)
    base.close()
    engine = build_engine(config, graph_backend=EmulatedGraphBackend())
    plan = engine.plan
    assert plan.uniform_decode_query_len == row_tokens
    assert all(s % row_tokens == 0 for s in plan.decode_capture_sizes)
    assert engine.speculator.pad_drafts == (row_tokens > 1)  # uniform runs of 1 + k tokens
    assert plan.single_token_decodes  # steps that verify nothing replay decode graphs too
    engine.speculator.pad_drafts = True  # k drafts every step (the random model repeats little)
    finals, _ = run_schedule(engine, _workload())
    for rid, tokens in eager_tokens[backend].items():
        assert finals[rid].outputs[0].token_ids == tokens, rid
    st = engine.stats()
    assert st.spec_decode["num_drafts"] > 0 and st.num_preemptions > 0
    assert st.graphs["graph_misses"] == 0, st.graphs["graph_miss_examples"]
    decode_mode = plan.decode_mode.value
    assert st.graphs["steps"][decode_mode] > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_hybrid_verification_in_piecewise_graphs(tiny_models):
    """A hybrid model (its Gated DeltaNet op runs between pieces, as attention does): verified
    runs of 1 + k tokens through its state in PIECEWISE graphs, zero misses, eager's tokens."""
    path = tiny_models["qwen3_next"]
    eager = _engine(path, "NONE", 0, "torch", graphs=False, kv=2**20)
    want, _ = run_schedule(eager, _workload())
    base = _engine(path, "PIECEWISE", 3, "torch", kv=2**20)
    config = replace(base.config, speculative=SPEC)
    base.close()
    engine = build_engine(config, graph_backend=EmulatedGraphBackend())
    assert engine.plan.uniform_decode_query_len == 4  # runs: one state per sequence
    engine.speculator.pad_drafts = True  # k drafts every step
    got, _ = run_schedule(engine, _workload())
    for rid in want:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
    st = engine.stats()
    assert st.spec_decode["num_drafts"] > 0
    assert st.graphs["graph_misses"] == 0 and st.graphs["steps"]["PIECEWISE"] > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
