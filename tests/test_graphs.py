"""Graph capture and replay on the CPU, through the emulated graph backend (a replay re-runs
the captured kernels on the captured tensors, as a CUDA graph does): every graph mode's greedy
tokens and logits equal eager on a mixed workload (arrivals at different steps, prefix hits,
preemption), steady decode runs with zero graph misses, padding rows change nothing, and the
capture ladder is cut to fit a fixed KV budget with a warning (an error when strict).
The same tests on a GPU use real CUDA graphs: see test_cuda.py and scripts/gpu_check.sh."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

from kiln import SamplingParams
from kiln.boot.capture import GraphMemoryEstimate, fit_ladder
from kiln.config import CompilationConfig
from kiln.config.graph_plan import RuntimeMode
from kiln.cudagraphs.full import FullGraphs
from kiln.cudagraphs.graph_backend import EmulatedGraphBackend, GraphBackend, unowned
from kiln.cudagraphs.piecewise import PiecewiseGraphs, RuntimeState
from kiln.errors import ConfigError
from kiln.layers.packed_experts import KQUANT_FORM, Q6K_FORM
from kiln.layers.q6k_kernel import q6k_matmul_kernel
from tests.helpers import make_engine, run_schedule

pytest.importorskip("triton")

SIZES = [1, 2, 4, 8, 16]
PREEMPTING = 96 * 512  # bytes: the tiny models keep 512 bytes of KV per token in fp32


def _workload():
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 49000, (24,), generator=g).tolist()
    prompts = [torch.randint(3, 49000, (n,), generator=g).tolist() for n in (3, 21, 9, 40)]
    prompts += [shared + prompts[0], shared + prompts[2]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [(t, p, params) for t, p in zip([0, 0, 1, 3, 5, 6], prompts)]


def _engine(
    path, cudagraph_mode, mode, backend, graphs=True, kv=2**20, piece_backend=None, tokenizer=None
):
    """kv=PREEMPTING: 96 tokens of KV for ~180 tokens of work, so sequences get preempted."""
    config = CompilationConfig(
        mode=mode,
        cudagraph_mode=cudagraph_mode,
        cudagraph_capture_sizes=SIZES,
        backend=piece_backend,
    )
    return make_engine(
        path,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        max_model_len=64,
        kv_cache_memory=kv,
        compilation=config if graphs else CompilationConfig(mode=mode),
        attention_backend=backend,
        graph_backend=EmulatedGraphBackend() if graphs else None,
        tokenizer=tokenizer,
    )


# (cudagraph mode, compilation mode, attention backend, runtime modes expected in the steps)
MODES = [
    ("FULL_DECODE_ONLY", 0, "triton", {"FULL", "NONE"}),
    ("FULL", 0, "triton", {"FULL"}),
    ("PIECEWISE", 3, "torch", {"PIECEWISE"}),
    ("FULL_AND_PIECEWISE", 3, "triton", {"FULL", "PIECEWISE"}),
    ("FULL_AND_PIECEWISE", 3, "torch", {"PIECEWISE"}),  # resolved: torch can't do FULL
]


def _reference(path: str, backend: str, tokenizer: str | None = None, kv: int = PREEMPTING):
    """An eager run of the workload, with a KV budget small enough to force preemption."""
    engine = _engine(path, "NONE", 0, backend, graphs=False, kv=kv, tokenizer=tokenizer)
    out = run_schedule(engine, _workload(), record_logits=True)
    assert engine.stats().num_preemptions > 0
    return out


@pytest.fixture(scope="module")
def references(tiny_models):
    """The llama model's eager runs per attention backend."""
    return {b: _reference(tiny_models["llama"], b) for b in ("torch", "triton")}


def _assert_equals_reference(finals, logits, reference, tol: float = 1e-4) -> None:
    """Eager's greedy tokens, and its logits within float32 noise (`tol`), for every request."""
    ref, ref_logits = reference
    for rid in ref:
        assert finals[rid].outputs[0].token_ids == ref[rid].outputs[0].token_ids
        a, b = torch.stack(logits[rid]), torch.stack(ref_logits[rid])
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())


@pytest.mark.parametrize(("graph_mode", "mode", "backend", "ran"), MODES)
def test_graph_mode_equals_eager(tiny_models, references, graph_mode, mode, backend, ran):
    engine = _engine(tiny_models["llama"], graph_mode, mode, backend, kv=PREEMPTING)
    assert engine.boot.capture.graphs > 0
    finals, logits = run_schedule(engine, _workload(), record_logits=True)
    _assert_equals_reference(finals, logits, references[backend])
    assert finals["5"].num_cached_tokens > 0  # prefix hits went through the graphs
    st = engine.stats()
    assert st.num_preemptions > 0  # and so did recomputed sequences
    steps = {m: n for m, n in st.graphs["steps"].items() if n}
    assert set(steps) == ran, steps
    assert st.graphs["graph_misses"] == 0
    # the attention ops fill an output the piece before them allocated: a PIECEWISE replay
    # finds every input at its captured address (it copied each layer's output before)
    assert st.graphs["piecewise_input_copies"] == 0


@pytest.mark.parametrize(("graph_mode", "mode", "backend", "ran"), [MODES[1], MODES[3]])
def test_graph_modes_of_an_moe_model_equal_eager(tiny_models, graph_mode, mode, backend, ran):
    """The experts' op (data-dependent grouping) inside FULL graphs and inside a compiled
    piece of PIECEWISE ones, padding rows routed like any token."""
    path = tiny_models["qwen3_moe"]
    engine = _engine(path, graph_mode, mode, backend, kv=PREEMPTING)
    finals, logits = run_schedule(engine, _workload(), record_logits=True)
    _assert_equals_reference(finals, logits, _reference(path, backend))
    st = engine.stats()
    assert {m for m, n in st.graphs["steps"].items() if n} == ran
    assert st.graphs["graph_misses"] == 0 and st.num_preemptions > 0


PACKED_GGUFS = {
    "llama": "packed_gguf",
    "qwen3_moe": "packed_moe_gguf",
    "k_quants": "k_quant_mix_gguf",
    "k_quant_moe": "k_quant_moe_gguf",
}


@pytest.mark.parametrize("model", ["llama", "qwen3_moe", "k_quants", "k_quant_moe"])
@pytest.mark.parametrize(("graph_mode", "mode", "backend", "ran"), [MODES[1], MODES[3]])
def test_graph_modes_of_a_packed_model_equal_eager(
    request, tiny_models, model, graph_mode, mode, backend, ran
):
    """Packed weights (the int4 kernel as an aten op in the graph; the two paths by the row
    count at run time; the packed experts' op, over int4 planes and over the Q6_K and K-quant
    kernels' buffers; Q6_K's and Q5_K's own ops beside int4 ones, where this CPU runs them)
    inside FULL graphs and inside compiled pieces of PIECEWISE ones."""
    k_quants = model.startswith("k_quant")
    if k_quants and q6k_matmul_kernel() is None:
        pytest.skip("kiln's Q6_K and K-quant kernels need AVX2 with FMA and a C++ compiler")
    path = request.getfixturevalue(PACKED_GGUFS[model])
    tokenizer = tiny_models["qwen3_moe" if "moe" in model else "llama"]
    kv = PREEMPTING * (4 if k_quants else 1)  # its KV is 4x the tiny models' a token
    engine = _engine(path, graph_mode, mode, backend, kv=kv, tokenizer=tokenizer)
    mlp = engine.runner.model.layers[0].mlp
    if "moe" not in model:
        assert mlp.down_proj.layout == ("q6_k" if k_quants else "int4")
        assert mlp.gate_up_proj.layout == ("q5_k" if k_quants else "int4")
    else:
        forms = [mlp.experts.packed[s].form for s in ("gate_up_proj", "down_proj")]
        assert forms == ([KQUANT_FORM, Q6K_FORM] if k_quants else [32, 32])
    finals, logits = run_schedule(engine, _workload(), record_logits=True)
    _assert_equals_within_bf16(finals, logits, _reference(path, backend, tokenizer, kv))
    st = engine.stats()
    assert {m for m, n in st.graphs["steps"].items() if n} == ran
    assert st.graphs["graph_misses"] == 0 and st.num_preemptions > 0
    if mode == 3:  # the packed model's trace saves for later boots like any other
        assert engine.runner.compile_backend.stats.trace in ("traced and saved", "loaded")


def _assert_equals_within_bf16(finals, logits, reference, tol: float = 2**-7) -> None:
    """The packed kernels round their outputs to bf16, so float32 noise (Inductor's fusions)
    can move a logit by an ulp of bf16: each step's logits within `tol` of eager's, and the
    same greedy token, unless eager's two best logits were within that noise (a tie, after
    which the sequences part and are not compared further)."""
    ref, ref_logits = reference
    for rid in ref:
        ours, theirs = finals[rid].outputs[0].token_ids, ref[rid].outputs[0].token_ids
        for step, (a, b) in enumerate(zip(logits[rid], ref_logits[rid])):
            bound = tol * b.abs().max().item()
            torch.testing.assert_close(a, b, rtol=0, atol=bound)
            if ours[step] != theirs[step]:
                top2 = b.topk(2).values
                assert top2[0] - top2[1] <= 2 * bound, (rid, step)
                break


def test_piecewise_graphs_of_uncompiled_pieces_equal_eager(tiny_models, references):
    """`backend: eager` keeps the split and the piecewise graphs, and leaves Inductor out: what
    tells an Inductor problem from a graph or split problem under PIECEWISE."""
    llama = tiny_models["llama"]
    engine = _engine(llama, "PIECEWISE", 3, "torch", kv=PREEMPTING, piece_backend="eager")
    assert engine.boot.capture.graphs > 0 and engine.plan.backend == "eager"
    finals, logits = run_schedule(engine, _workload(), record_logits=True)
    _assert_equals_reference(finals, logits, references["torch"])
    st = engine.stats().graphs
    assert st["steps"]["PIECEWISE"] > 0 and st["steps"]["NONE"] == st["graph_misses"] == 0


def test_a_graph_miss_is_counted_and_told(tiny_models, caplog):
    """A step the plan promised a graph, whose graph is not there, still runs (eagerly), is
    counted with its descriptor, and the first such step after capture is logged."""
    engine = _engine(tiny_models["llama"], "FULL_DECODE_ONLY", 0, "triton")
    del engine.runner.full.graphs[1]  # the single-request decode graph
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with caplog.at_level(logging.WARNING):
        finals, _ = run_schedule(engine, [(0, [5, 6, 7], params)])
    eager = _engine(tiny_models["llama"], "NONE", 0, "triton", graphs=False)
    reference, _ = run_schedule(eager, [(0, [5, 6, 7], params)])
    assert finals["0"].outputs[0].token_ids == reference["0"].outputs[0].token_ids
    st = engine.stats().graphs
    assert st["graph_misses"] == 3 == st["steps"]["NONE"] - 1  # three decodes; the prefill: NONE
    example = "FULL num_tokens=1 num_reqs=1 uniform_token_count=1"
    assert st["graph_miss_examples"] == [example] * 3
    (warning,) = [r.getMessage() for r in caplog.records if "graph miss" in r.getMessage()]
    assert example in warning and "please report it" in warning


def test_compiled_full_graphs_equal_eager(tiny_models):
    """mode 3 with FULL graphs (the GPU benchmark's FULL row): one Inductor graph with the
    attention op inside, captured whole at every size, for a prefill arriving beside a decode
    and the decodes after. A short workload: every step runs Triton's CPU interpreter."""
    workload = _workload()[1:3]  # 21 and 9 tokens, the second arriving a step later
    eager = _engine(tiny_models["llama"], "NONE", 0, "triton", graphs=False)
    reference = run_schedule(eager, workload, record_logits=True)
    engine = _engine(tiny_models["llama"], "FULL", 3, "triton")
    assert engine.runner.compile_backend.stats.pieces == 1  # not split
    finals, logits = run_schedule(engine, workload, record_logits=True)
    _assert_equals_reference(finals, logits, reference)
    st = engine.stats().graphs
    assert st["steps"]["FULL"] > 0 and st["steps"]["NONE"] == st["graph_misses"] == 0


def _gpu_boot_engine(tiny_models, graph_backend: GraphBackend):
    """The tiny llama in mode 3 with PIECEWISE graphs over `graph_backend`, which runs the GPU's
    boot sequence (measure on two blocks, size the KV cache, capture again)."""
    config = CompilationConfig(mode=3, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=SIZES)
    return make_engine(
        tiny_models["llama"],
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        max_model_len=64,
        kv_cache_memory=PREEMPTING,
        compilation=config,
        attention_backend="torch",
        graph_backend=graph_backend,
    )


def test_gpu_boot_sequence_compiles_once_and_equals_eager(tiny_models, references):
    """The GPU's boot: the largest graphs are captured on a provisional two-block KV cache to
    measure them, dropped, and captured again on the real cache. The compiled forward serves
    both caches (their block count is symbolic): before, binding the real cache failed a guard
    and compiled the whole model a second time."""
    engine = _gpu_boot_engine(tiny_models, EmulatedGraphBackend(measures_memory=True))
    assert engine.boot.capture.measured  # the measurement ran, on two blocks
    assert engine.runner.kv_caches[0][0].shape[0] > 2
    # it captured the whole ladder, as the real capture did after it
    assert engine.runner.graph_backend.captures == 2 * engine.boot.capture.graphs
    assert engine.runner.compile_backend.stats.compilations == 1
    finals, logits = run_schedule(engine, _workload(), record_logits=True)
    _assert_equals_reference(finals, logits, references["torch"])
    assert engine.stats().graphs["recompilations"] == 0


class _PoolMemoryBackend(EmulatedGraphBackend):
    """Device memory as CUDA graphs spend it: each live graph holds `per_graph` bytes until the
    runner drops it, and the first capture loads `loaded` bytes that stay (kernels for sizes
    the warm-up did not run, a workspace)."""

    def __init__(self, per_graph: int, loaded: int) -> None:
        super().__init__(measures_memory=True)
        self.per_graph, self.loaded = per_graph, loaded
        self.live: weakref.WeakSet = weakref.WeakSet()

    def capture(self, fn):
        replay, out = super().capture(fn)
        self.live.add(replay)
        return replay, out

    def memory_in_use(self) -> int:
        gc.collect()
        return self.loaded * (self.captures > 0) + self.per_graph * len(self.live)


def test_graph_memory_reserved_before_kv_sizing_is_what_the_real_capture_takes(tiny_models):
    """What the measuring captures load once (kernels, workspaces) is still loaded when the KV
    cache is sized and is not paid again: the reservation leaves it out (on an H200 it made
    the reservation 1.6x the graphs' memory)."""
    backend = _PoolMemoryBackend(per_graph=1000, loaded=50_000)
    engine = _gpu_boot_engine(tiny_models, backend)
    cap = engine.boot.capture
    assert cap.graphs > 0 and backend.captures == 2 * cap.graphs
    assert cap.memory_bytes == cap.reserved_bytes == 1000 * cap.graphs


@pytest.mark.parametrize("graph_mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_steady_decode_has_no_graph_misses(tiny_models, graph_mode):
    engine = _engine(
        tiny_models["llama"], graph_mode, 3 if "PIECEWISE" in graph_mode else 0, "triton"
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    run_schedule(engine, [(0, [5 + i] * 6, params) for i in range(5)])
    st = engine.stats().graphs
    assert st["graph_misses"] == 0
    assert st["steps"]["FULL"] >= 10  # every decode step of 5 requests replayed size 8


def test_full_graph_replays_read_the_buffers():
    """A replay sees the buffers' current contents and writes the captured output tensor."""
    gb = EmulatedGraphBackend()
    buf = torch.zeros(8)
    graphs = FullGraphs(gb)
    graphs.capture(4, lambda: buf[:4] * 2)
    out = graphs.run(4)
    buf[:4] = torch.arange(4.0)
    again = graphs.run(4)
    assert again.data_ptr() == out.data_ptr() and again.tolist() == [0, 2, 4, 6]


def test_piecewise_copies_inputs_that_moved():
    gb = EmulatedGraphBackend()
    pw = PiecewiseGraphs(gb)
    weight = torch.full((3,), 2.0)
    x0 = torch.ones(3)
    pw.state = RuntimeState(RuntimeMode.PIECEWISE, 3, capturing=True)
    pw.call("p", torch.mul, (x0, weight))
    pw.sizes.add(3)
    pw.state = RuntimeState(RuntimeMode.PIECEWISE, 3)
    fresh = torch.tensor([1.0, 2.0, 3.0])  # a splitting op's new output tensor
    out = pw.call("p", torch.mul, (fresh, weight))
    assert out.tolist() == [2.0, 4.0, 6.0]
    assert pw.copies == 1  # the moved input was copied; the weight was not
    pw.state = RuntimeState()
    assert pw.call("p", torch.add, (fresh, weight)).tolist() == [3.0, 4.0, 5.0]  # NONE: plain


def test_unowned_aliases_memory_without_keeping_it():
    from torch.multiprocessing.reductions import StorageWeakRef

    base = torch.arange(12.0)
    view = base[2:10].view(2, 4)
    alias = unowned(view)
    assert (alias.data_ptr(), alias.shape, alias.stride()) == (
        view.data_ptr(),
        view.shape,
        view.stride(),
    )
    alias[0, 0] = 99.0
    assert base[2] == 99.0  # the same memory
    storage = StorageWeakRef(base.untyped_storage())
    del base, view
    assert storage.expired()  # and not kept allocated by the alias
    assert unowned((1, None)) == (1, None)


class _PoolBackend(GraphBackend):
    """Captures like a CUDA graph pool as far as Python sees it: the memory is the pool's, no
    Python object holds the outputs (never replayed: the memory is not really kept here)."""

    def capture(self, fn):
        return (lambda: None), fn()


def test_piecewise_graphs_hold_their_outputs_unowned():
    """Graph outputs go back to the pool when a capture's forward drops them, so the next
    (smaller) size's captures reuse that memory; held by the graphs, every (piece, size) would
    keep its own and the pool would grow with the sum of the ladder."""
    import gc
    import weakref

    pw = PiecewiseGraphs(_PoolBackend())
    weight, x = torch.full((4,), 2.0), torch.ones(4)
    pw.state = RuntimeState(RuntimeMode.PIECEWISE, 4, capturing=True)
    first = pw.call("p0", torch.mul, (x, weight))
    second = pw.call("p1", torch.add, (first, weight))
    ptrs = [first.data_ptr(), second.data_ptr()]
    refs = [weakref.ref(first), weakref.ref(second)]
    del first, second
    gc.collect()
    assert [r() for r in refs] == [None, None]  # nothing of kiln's holds the outputs
    p0, p1 = pw.graphs[("p0", 4)], pw.graphs[("p1", 4)]
    assert [p0.outputs.data_ptr(), p1.outputs.data_ptr()] == ptrs  # their aliases remain
    assert p1.inputs[0].data_ptr() == ptrs[0]  # an earlier graph's output: an alias too
    assert p0.inputs[0] is x and p0.inputs[1] is weight  # anything else is held
    pw.clear()
    assert not pw.graphs and not pw.pool_outputs


def _plan(sizes):
    from kiln.attention.backend import GraphSupport
    from kiln.config.graph_plan import AttentionCaps, DeviceCaps, resolve_graph_plan

    return resolve_graph_plan(
        CompilationConfig(
            mode=3, cudagraph_mode="FULL_AND_PIECEWISE", cudagraph_capture_sizes=sizes
        ),
        DeviceCaps("cuda", True),
        AttentionCaps("triton_paged", GraphSupport.ALWAYS, ("kiln::triton_paged_attention",)),
        max_num_batched_tokens=512,
        max_num_seqs=256,
    )


def test_ladder_fits_unchanged():
    plan = _plan([1, 2, 4, 8, 256])
    est = GraphMemoryEstimate(measured_bytes=2**30, largest_size=256)
    assert fit_ladder(plan, est, 2**30, strict=False) is plan


def test_ladder_is_cut_to_the_memory_left_with_a_warning(caplog):
    plan = _plan([1, 2, 4, 8, 16, 128, 256])
    est = GraphMemoryEstimate(measured_bytes=2**30, largest_size=256)  # 4 MiB per token
    with caplog.at_level(logging.WARNING):
        cut = fit_ladder(plan, est, 100 * 2**20, strict=False)  # room for 25 tokens
    assert cut.mixed_capture_sizes == (1, 2, 4, 8, 16)
    assert cut.decode_capture_sizes == (1, 2, 4, 8, 16)
    (msg,) = [r.getMessage() for r in caplog.records if "capture sizes" in r.getMessage()]
    assert "dropped sizes [128, 256]" in msg and "--kv-cache-memory" in msg
    assert cut.changes[-1].field == "capture sizes"
    with pytest.raises(ConfigError, match="--strict-graphs: capture sizes"):
        fit_ladder(plan, est, 100 * 2**20, strict=True)


def test_close_frees_cache_and_graphs(tiny_models):
    """close() lets go of the KV cache and every captured graph at once (a second engine in the
    same process sizes its KV cache from the memory left), and refuses new requests. Boot froze
    its objects out of the garbage collector's passes; close() gives them back to it."""
    import gc
    import weakref

    from kiln.errors import EngineClosedError

    engine = _engine(tiny_models["llama"], "FULL_DECODE_ONLY", 0, "triton")
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    run_schedule(engine, [(0, [5, 6, 7], params)])
    assert engine.runner.full.graphs
    cache = weakref.ref(engine.runner.kv_caches[0][0])
    graph_output = weakref.ref(engine.runner.full.graphs[max(engine.runner.full.graphs)].outputs)
    assert gc.get_freeze_count() > 0
    engine.close()
    assert gc.get_freeze_count() == 0
    assert cache() is None and graph_output() is None
    assert not engine.runner.full.graphs
    with pytest.raises(EngineClosedError, match="build a new one"):
        engine.add_request("late", [5, 6], params)
