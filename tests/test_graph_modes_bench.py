"""benchmarks/graph_modes.py, the compilation issue's benchmark: its interleaved rounds measure
every configuration each round, and a round's prompts never hit the prefix cache that an
earlier round of the same engine filled (a hit would inflate prefill throughput)."""

import argparse
import json

import pytest

from kiln import LLM
from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def graph_modes():
    return load_benchmark("graph_modes")


def test_a_later_round_hits_no_prefix_cache(graph_modes, tiny_models):
    llm = LLM(tiny_models["llama"], kv_cache_memory="64MiB", max_num_seqs=4)
    try:
        graph_modes.measure(llm, [1, 2], prefill_len=48, steps=2, salt=0)
        before = llm.engine.stats().prefix_cache_hit_tokens
        graph_modes.measure(llm, [1, 2], prefill_len=48, steps=2, salt=1)
        # only the 48-token prefill warm-up repeats (by design); a repeated measured prompt
        # would add at least 32 more
        assert llm.engine.stats().prefix_cache_hit_tokens - before <= 48
    finally:
        llm.close()


def test_interleaved_rounds_keep_every_round(graph_modes, tiny_models):
    boot = dict(kv_cache_memory="64MiB", max_num_seqs=4, max_num_batched_tokens=64)
    args = argparse.Namespace(rounds=2, steps=2, output=None)
    configs = ['{"mode": 0}', '{"mode": 0, "cudagraph_mode": "NONE"}']
    rows, floors = graph_modes.interleaved(tiny_models["llama"], configs, boot, [1, 2], 32, args)
    assert [r["config"] for r in rows] == configs
    assert len(floors) == 2 and all(f > 0 for f in floors)  # the CPU: one b=1 floor per round
    line = graph_modes.floor_line(rows, floors)
    assert all(f"{c} " in line for c in configs) and line.startswith("b=1 floor")
    for r in rows:
        assert r["resolved"] == "mode 0 NONE"
        for b in (1, 2):
            rounds = r["decode_ms_rounds"][b]
            assert len(rounds) == 2 and r["decode_ms"][b] == pytest.approx(sum(rounds) / 2)
        assert len(r["prefill_tok_s_rounds"]) == 2 and r["prefill_tok_s"] > 0


def test_the_floor_runs_every_linear_and_the_lm_head_once_per_pass(graph_modes, tiny_models):
    """The b=1 floor streams each weight a decode step streams, once per pass, at one row."""
    from kiln.layers.linear import Linear

    llm = LLM(tiny_models["llama"], kv_cache_memory="64MiB", max_num_seqs=4)
    try:
        model = llm.engine.runner.model
        calls, logits_rows = [], []
        layers = [m for m in model.modules() if isinstance(m, Linear)]
        for m in layers:
            m.register_forward_hook(lambda mod, args, out: calls.append((mod, args[0].shape[0])))
        compute_logits = model.compute_logits
        model.compute_logits = lambda h: logits_rows.append(h.shape[0]) or compute_logits(h)
        assert graph_modes.linears_ms(llm, passes=3) > 0
        # per layer: qkv, o, gate_up, down; then the untied LM head, once, in compute_logits
        assert len(layers) == 4 * llm.engine.model_config.num_layers + 1
        assert sorted(map(id, (m for m, _ in calls))) == sorted(map(id, layers * 5))
        assert {rows for _, rows in calls} == {1} and logits_rows == [1] * 5
    finally:
        llm.close()


@pytest.mark.parametrize("graph_mode", ["FULL", "PIECEWISE", "FULL_AND_PIECEWISE"])
def test_gpu_configs_run_each_batch_in_the_graph_the_default_ladder_would(graph_mode, graph_modes):
    """On a GPU the benchmark captures only the measured batch sizes; every decode batch it
    measures must still run in a graph of its own size and mode, as under the full ladder, and
    the prefill above both ladders."""
    from kiln.attention.backend import GraphSupport
    from kiln.config.compilation import CompilationConfig
    from kiln.config.graph_plan import AttentionCaps, DeviceCaps, resolve_graph_plan
    from kiln.cudagraphs.dispatcher import describe, dispatch

    batches = [1, 8, 32, 128]
    attention = AttentionCaps("triton", GraphSupport.ALWAYS, ("kiln::triton_paged_attention",))

    def plan(config: dict):
        return resolve_graph_plan(
            CompilationConfig(**config),
            DeviceCaps("cuda", True),
            attention,
            max_num_batched_tokens=2048,
            max_num_seqs=128,
        )

    measured = plan(json.loads(graph_modes.gpu_config(graph_mode, batches)))
    ladder = plan({"mode": 3, "cudagraph_mode": graph_mode})
    assert not measured.changes
    for lens in [[1] * b for b in batches] + [[2048]]:
        a, b = dispatch(measured, describe(lens)), dispatch(ladder, describe(lens))
        assert (a.mode, a.descriptor) == (b.mode, b.descriptor)
    assert dispatch(measured, describe([1] * 8)).descriptor.num_tokens == 8
