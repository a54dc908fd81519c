"""CUDA checks (skipped without a GPU): the engine on a CUDA device against HF transformers,
and real CUDA graphs in each of the five graph modes: greedy tokens and logits equal eager on a
mixed workload (arrivals at different steps, prefix hits, preemption) with no input copied
into a PIECEWISE graph, zero graph misses on a steady decode, the graph memory measured at
capture within 10% of what was reserved before the KV cache was sized, and the graphs of
every capture size sharing one pool (the ladder costs about what its largest size does)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln import SamplingParams, build_engine
from kiln.boot.capture import GraphCapture
from kiln.config import CompilationConfig
from kiln.config.engine import CacheConfig, EngineConfig, SchedulerConfig
from kiln.config.graph_plan import RuntimeMode
from kiln.engine.llm_engine import LLMEngine
from tests.helpers import load_benchmark, run_schedule

pytestmark = pytest.mark.cuda

SIZES = [1, 2, 4, 8, 16, 32]


PREEMPTING = 160 * 512  # 160 tokens of fp32 KV of the tiny models, for ~300 tokens of work


def _engine(
    path: str,
    dtype: str,
    compilation: CompilationConfig,
    kv: int | None = 256 * 2**20,
    max_model_len: int | None = None,
    max_num_batched_tokens: int = 32,
) -> LLMEngine:
    cache = CacheConfig(block_size=16, kv_cache_memory=kv)
    if kv is None:
        cache = CacheConfig(block_size=16, kv_cache_memory_fraction=0.05)
    return build_engine(
        EngineConfig(
            model=path,
            dtype=dtype,
            device="cuda",
            cache=cache,
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=8,
                max_model_len=max_model_len,
            ),
            compilation=compilation,
        )
    )


@pytest.mark.parametrize("mode", [0, 3])
@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_next", "qwen3_5"])
def test_cuda_logits_match_hf(tiny_models, name, mode):
    """The hybrids' Gated DeltaNet layers take the Triton core beside the Triton backend."""
    engine = _engine(
        tiny_models[name], "float32", CompilationConfig(mode=mode, cudagraph_mode="NONE")
    )
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


def _workload():
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 49000, (40,), generator=g).tolist()
    prompts = [torch.randint(3, 49000, (n,), generator=g).tolist() for n in (3, 50, 9, 90)]
    prompts += [shared + prompts[0], shared + prompts[2]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [(t, p, params) for t, p in zip([0, 0, 1, 3, 5, 6], prompts)]


@pytest.fixture(scope="module")
def eager_reference(tiny_models):
    engine = _engine(
        tiny_models["llama"],
        "float32",
        CompilationConfig(mode=0, cudagraph_mode="NONE"),
        kv=PREEMPTING,
        max_model_len=128,
    )
    return run_schedule(engine, _workload(), record_logits=True), engine.stats().num_preemptions


def _assert_equals_reference(finals, logits, ref, ref_logits) -> None:
    """Eager's greedy tokens, and its logits within the GPU's float32 noise, for every request."""
    for rid in ref:
        assert finals[rid].outputs[0].token_ids == ref[rid].outputs[0].token_ids
        a, b = torch.stack(logits[rid]), torch.stack(ref_logits[rid])
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * b.abs().max().item())


GRAPH_MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


@pytest.mark.parametrize("graph_mode", GRAPH_MODES)
def test_cuda_graph_mode_equals_eager(tiny_models, eager_reference, graph_mode):
    (ref, ref_logits), preemptions = eager_reference
    config = CompilationConfig(mode=3, cudagraph_mode=graph_mode, cudagraph_capture_sizes=SIZES)
    engine = _engine(tiny_models["llama"], "float32", config, kv=PREEMPTING, max_model_len=128)
    assert engine.plan.cudagraph_mode.value == graph_mode and not engine.plan.changes
    # one compilation: the graph-memory measurement's two-block KV cache and the real one
    # share the compiled forward (the block count is symbolic)
    assert engine.runner.compile_backend.stats.compilations == 1
    finals, logits = run_schedule(engine, _workload(), record_logits=True)
    _assert_equals_reference(finals, logits, ref, ref_logits)
    st = engine.stats()
    assert finals["5"].num_cached_tokens > 0
    assert st.num_preemptions == preemptions > 0
    assert st.graphs["graph_misses"] == 0 and st.graphs["recompilations"] == 0
    assert st.graphs["piecewise_input_copies"] == 0
    if graph_mode != "NONE":
        assert engine.boot.capture.graphs > 0


@pytest.fixture(scope="module")
def hybrid_eager_reference(tiny_models):
    engine = _engine(tiny_models["qwen3_next"], "float32",
                     CompilationConfig(mode=0, cudagraph_mode="NONE"))  # fmt: skip
    return run_schedule(engine, _workload(), record_logits=True)


@pytest.mark.parametrize("graph_mode", GRAPH_MODES)
def test_cuda_hybrid_graph_mode_equals_eager(tiny_models, hybrid_eager_reference, graph_mode):
    """A hybrid (Gated DeltaNet layers, experts) in real CUDA graphs: the Triton core is
    captured, so every mode stays what was asked, and prefix hits restore saved states."""
    config = CompilationConfig(mode=3, cudagraph_mode=graph_mode, cudagraph_capture_sizes=SIZES)
    engine = _engine(tiny_models["qwen3_next"], "float32", config)
    assert engine.plan.cudagraph_mode.value == graph_mode and not engine.plan.changes
    finals, logits = run_schedule(engine, _workload(), record_logits=True)
    _assert_equals_reference(finals, logits, *hybrid_eager_reference)
    st = engine.stats()
    assert finals["5"].num_cached_tokens > 0
    assert st.graphs["graph_misses"] == 0 and st.graphs["recompilations"] == 0
    slots = engine.blocks.state_slots
    assert slots.num_free == slots.num_slots


@pytest.mark.parametrize("graph_mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_cuda_steady_decode_has_no_graph_misses(tiny_models, graph_mode):
    mode = 3 if "PIECEWISE" in graph_mode else 0
    config = CompilationConfig(mode=mode, cudagraph_mode=graph_mode, cudagraph_capture_sizes=SIZES)
    engine = _engine(tiny_models["llama"], "bfloat16", config)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    run_schedule(engine, [(0, [5 + i] * 6, params) for i in range(6)])
    st = engine.stats().graphs
    assert st["graph_misses"] == 0 and st["steps"]["FULL"] >= 18


@pytest.fixture(scope="module")
def wide_model() -> str:
    """Qwen3-0.6B's widths in two layers: wide enough that graph memory is tens of MB, far
    above the allocator's 2 MB segments, so that how it scales with the ladder shows."""
    return load_benchmark("graph_modes").random_qwen3_0_6b("float32", num_layers=2)


@pytest.fixture(scope="module")
def wide_engine(wide_model):
    """FULL_AND_PIECEWISE with the default ladder of a 512-token budget (67 sizes)."""
    config = CompilationConfig(mode=3, cudagraph_mode="FULL_AND_PIECEWISE")
    return _engine(wide_model, "float32", config, kv=None, max_num_batched_tokens=512)


def test_cuda_graph_memory_within_ten_percent_of_the_reservation(wide_engine):
    cap = wide_engine.boot.capture
    assert len(wide_engine.plan.mixed_capture_sizes) == 67
    assert cap.graphs > 0 and cap.reserved_bytes > 0
    assert abs(cap.memory_bytes - cap.reserved_bytes) <= 0.1 * cap.reserved_bytes, cap


def test_cuda_graphs_of_every_size_share_one_pool(wide_model, wide_engine):
    """The whole ladder against its largest size alone: graphs that kept their outputs would
    cost the sum of the sizes (32x the largest for these 67); sharing the pool, about 1x plus
    what each graph costs the device. Then the mixed workload, whose steps replay graphs of
    several sizes one after another over the shared memory, still equals eager."""
    runner = wide_engine.runner
    capture, gb = GraphCapture(runner), runner.graph_backend
    sizes = capture.sizes(RuntimeMode.PIECEWISE)

    def captured(run_captures) -> int:
        runner.drop_graphs()
        gb.release()
        before = gb.memory_in_use()
        run_captures()
        return gb.memory_in_use() - before

    largest = captured(lambda: capture.capture_size(RuntimeMode.PIECEWISE, max(sizes)))
    ladder = captured(capture.capture_all)
    unshared = largest * sum(sizes) / max(sizes)
    assert largest > 0 and ladder < unshared / 4, (largest, ladder, unshared)
    eager_config = CompilationConfig(mode=0, cudagraph_mode="NONE")
    eager = _engine(wide_model, "float32", eager_config, kv=None, max_num_batched_tokens=512)
    ref, ref_logits = run_schedule(eager, _workload(), record_logits=True)
    finals, logits = run_schedule(wide_engine, _workload(), record_logits=True)
    _assert_equals_reference(finals, logits, ref, ref_logits)
    st = wide_engine.stats().graphs
    assert st["graph_misses"] == 0 and st["steps"]["FULL"] > 0 and st["steps"]["PIECEWISE"] > 0


@pytest.mark.parametrize("piece_backend", ["eager", "aot_eager"])
def test_cuda_graphs_of_pieces_without_inductor_equal_eager(
    tiny_models, eager_reference, piece_backend
):
    """`backend: eager` / `aot_eager` (bisecting a compiled-mode problem) under real FULL and
    PIECEWISE graphs: the pieces run as traced, without Inductor, captured all the same."""
    (ref, ref_logits), _ = eager_reference
    config = CompilationConfig(
        mode=3,
        cudagraph_mode="FULL_AND_PIECEWISE",
        cudagraph_capture_sizes=SIZES,
        backend=piece_backend,
    )
    engine = _engine(tiny_models["llama"], "float32", config, kv=PREEMPTING, max_model_len=128)
    assert engine.plan.backend == piece_backend and engine.boot.capture.graphs > 0
    finals, logits = run_schedule(engine, _workload(), record_logits=True)
    _assert_equals_reference(finals, logits, ref, ref_logits)
    st = engine.stats().graphs
    assert st["steps"]["FULL"] > 0 and st["steps"]["PIECEWISE"] > 0 and st["graph_misses"] == 0


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q8_0"])
def test_packed_matmul_on_cuda_matches_dequantized_and_replays_in_a_graph(kind):
    """tinygemm's int4 kernel on the packed planes, eager and replayed in a CUDA graph."""
    from kiln.layers.packed import PackedInt4
    from tests.test_packed import BF16_ULP, _gguf_tensor

    ref_w, planes = _gguf_tensor(kind, 200, 512)  # 200 rows: padded to tinygemm's 8
    packed = PackedInt4(planes, torch.device("cuda"))
    w = torch.from_numpy(ref_w).cuda()
    torch.testing.assert_close(packed.dequantize(), w, rtol=0,
                               atol=2 * BF16_ULP * w.abs().max().item())  # fmt: skip
    for rows in (1, 7, 300):
        x = torch.randn(rows, 512, device="cuda")
        ref = x.bfloat16().float() @ w.t()
        torch.testing.assert_close(packed(x), ref, rtol=0,
                                   atol=4 * BF16_ULP * ref.abs().max().item())  # fmt: skip
    static_x = torch.randn(4, 512, device="cuda")
    packed(static_x)  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = packed(static_x)
    static_x.copy_(torch.randn(4, 512, device="cuda"))
    graph.replay()
    torch.testing.assert_close(static_y, packed(static_x), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_packed_experts_on_cuda_match_dequantized_and_replay_in_a_graph(kind):
    """Experts kept 4-bit on CUDA (the Triton grouped int4 kernel), eager in bf16 against the
    per-token product on the dequantized weights, and replayed in a CUDA graph."""
    from tests.test_packed_experts import BF16_ULP, _experts, _per_token, _routing

    cuda = torch.device("cuda")
    experts, gate_up, down = _experts([kind] * 3, device=cuda)
    assert set(experts.packed) == {"gate_up_proj", "down_proj"}
    assert experts.packed["down_proj"].packed0.device.type == "cuda"
    x, ids, weights = _routing(9)
    ref = _per_token(x, gate_up, down, ids, weights)
    args = (x.cuda().bfloat16(), ids.cuda(), weights.cuda().bfloat16())
    torch.testing.assert_close(experts(*args).float().cpu(), ref, rtol=0,
                               atol=16 * BF16_ULP * ref.abs().max().item())  # fmt: skip
    static = [a.clone() for a in args]
    experts(*static)  # warm: compiles the kernel
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = experts(*static)
    x2, ids2, weights2 = _routing(9, seed=4)
    for s, new in zip(static, (x2.bfloat16(), ids2, weights2.bfloat16()), strict=True):
        s.copy_(new)
    graph.replay()
    torch.testing.assert_close(static_y, experts(*static), rtol=0, atol=0)


def test_packed_model_in_full_and_piecewise_graphs_equals_eager(tiny_models, packed_gguf):
    def engine(config: CompilationConfig) -> LLMEngine:
        scheduler = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=128)
        cache = CacheConfig(block_size=16, kv_cache_memory=PREEMPTING)
        return build_engine(
            EngineConfig(model=packed_gguf, tokenizer=tiny_models["llama"], device="cuda",
                         cache=cache, scheduler=scheduler, compilation=config)
        )  # fmt: skip

    eager = engine(CompilationConfig(mode=0, cudagraph_mode="NONE"))
    ref, ref_logits = run_schedule(eager, _workload(), record_logits=True)
    config = CompilationConfig(
        mode=3, cudagraph_mode="FULL_AND_PIECEWISE", cudagraph_capture_sizes=SIZES
    )
    graphs = engine(config)
    assert graphs.runner.model.layers[0].mlp.down_proj.layout == "int4"
    finals, logits = run_schedule(graphs, _workload(), record_logits=True)
    from tests.test_graphs import _assert_equals_within_bf16  # bf16 kernel outputs

    _assert_equals_within_bf16(finals, logits, (ref, ref_logits))
    assert graphs.stats().graphs["graph_misses"] == 0
