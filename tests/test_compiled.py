"""Compiled mode (mode 3) on the CPU: the split backend's logits equal eager's for prefill,
decode and mixed batches of every size, one compilation serves them all, tensors at split
boundaries are contiguous (checked), and a recompilation is counted and warned about."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from kiln import SamplingParams
from kiln.compiler.direct_calls import register_direct_calls
from kiln.compiler.split_backend import (
    ContiguityError,
    _check_contiguous,
    _Piece,
    _SplitCall,
    model_guard_filter,
)
from kiln.compiler.vec_isa_probe import wants_probe
from kiln.config import CompilationConfig
from kiln.config.plan_table import plan_table
from tests.helpers import forward_with_int32_positions, make_engine, run_schedule

# split at attention explicitly: with no piecewise graphs to replay (the CPU) the default is
# one unsplit graph, and these tests are about the split backend
SPLIT = ("kiln::cpu_paged_attention",)  # the CPU's attention backend
COMPILED = CompilationConfig(mode=3, splitting_ops=SPLIT, debug_contiguity=True)


def _schedule():
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 49000, (20,), generator=g).tolist()
    prompts = [torch.randint(3, 49000, (n,), generator=g).tolist() for n in (3, 17, 30, 9)]
    prompts += [shared + prompts[0], shared + prompts[1]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    # arrivals spread so decodes of 1..6 requests mix with prefill chunks
    return [(t, p, params) for t, p in zip([0, 0, 1, 2, 4, 6], prompts)]


def _assert_matches_eager(
    eager, compiled, rtol: float = 1e-4, atol: float = 1e-4, near_ties: bool = False
) -> dict:
    """The schedule's greedy tokens and logits on `compiled` equal eager's (`atol` relative to
    the largest logit); its outputs. `near_ties` (bf16, where logits tie within rounding): a
    token may differ where eager's two best logits are within twice the tolerance of each other,
    and the request is compared up to there (its inputs differ after)."""
    ref, ref_logits = run_schedule(eager, _schedule(), record_logits=True)
    out, logits = run_schedule(compiled, _schedule(), record_logits=True)
    for rid in ref:
        want, got = ref[rid].outputs[0].token_ids, out[rid].outputs[0].token_ids
        a, b = torch.stack(logits[rid]).float(), torch.stack(ref_logits[rid]).float()
        tol = atol * b.abs().max().item()
        steps = len(want)
        if near_ties and got != want:
            steps = next(i for i, (x, y) in enumerate(zip(got, want)) if x != y)
            top2 = b[steps].topk(2).values
            assert top2[0] - top2[1] <= 2 * tol, f"request {rid} left eager's token by a margin"
        else:
            assert got == want
        torch.testing.assert_close(a[: steps + 1], b[: steps + 1], rtol=rtol, atol=tol)
    return out


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe"])
def engines(request, tiny_models, tmp_path_factory):
    path = tiny_models[request.param]
    eager = make_engine(path, block_size=4, max_num_batched_tokens=16)
    dump = str(tmp_path_factory.mktemp(f"dump_{request.param}"))
    config = dataclasses.replace(COMPILED, debug_dump_path=dump)
    compiled = make_engine(path, block_size=4, max_num_batched_tokens=16, compilation=config)
    return eager, compiled


def test_compiled_logits_equal_eager(engines):
    eager, compiled = engines
    out = _assert_matches_eager(eager, compiled)
    assert out["5"].num_cached_tokens > 0  # prefix hits ran through the compiled path too


def test_one_compilation_serves_every_batch_size(engines):
    _, compiled = engines
    stats = compiled.runner.compile_backend.stats
    before = stats.compilations
    for n in (1, 2, 3, 5, 8, 16):  # decode batches of n requests, then their prefills
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        run_schedule(compiled, [(0, [7 + i] * (2 + i), params) for i in range(n)])
    assert stats.compilations == before == 1
    assert stats.recompilations == 0
    assert compiled.stats().graphs["recompilations"] == 0
    assert stats.pieces == compiled.model_config.num_layers + 1
    assert stats.splitting_op_calls == compiled.model_config.num_layers


def test_compile_time_is_measured(engines):
    """What /v1/engine and `kiln info` report: the compiling call's wall time, of which kiln's
    backend is a part, within the warm-up phase that made it."""
    _, compiled = engines
    info = compiled.runner.compile_stats()
    assert (info["backend"], info["compilations"]) == ("inductor", 1)
    assert info["pieces"] == compiled.model_config.num_layers + 1
    assert 0 < info["backend_s"] < info["compile_s"] <= compiled.boot.phases_s["warm_up"]


def test_the_cpu_isa_probe_ran_before_the_pieces_compiled(engines):
    """Inductor's probe of the CPU's vector instruction sets started with the compiled CPU
    engine, in its own thread, and has finished (the first piece compile waits for it); its
    answer is cached where Inductor's C++ code generation reads it."""
    from torch._inductor import cpu_vec_isa

    _, compiled = engines
    probe = compiled.runner.compile_backend.compiler.vec_isa_probe
    assert probe is not None and probe.done
    assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 1


@pytest.mark.parametrize(
    ("device", "backend", "options", "expected"),
    [
        ("cpu", "inductor", {}, True),
        ("cpu", "inductor", {"max_autotune": True}, True),
        ("cuda", "inductor", {}, False),  # Triton code: no C++ vector ISA
        ("cpu", "eager", {}, False),
        ("cpu", "aot_eager", {}, False),
        ("cpu", "inductor", {"cpp.vec_isa_ok": False}, False),  # Inductor must check under it
        ("cpu", None, {}, False),  # mode 0
    ],
)
def test_the_isa_probe_starts_only_where_inductor_cpu_code_uses_it(
    device, backend, options, expected
):
    assert wants_probe(device, backend, options) is expected


def test_the_plan_only_preview_is_what_boot_resolved(engines):
    """`kiln info --plan-only`: the same plan and compile cache entry as the boot of that
    configuration, found sealed, without loading a weight or compiling."""
    from kiln.attention.torch_backend import TorchPagedAttentionBackend
    from kiln.boot.preview import keyed_model, preview_engine
    from kiln.compile_cache.entry import entry_for_plan, is_sealed

    _, compiled = engines
    preview = preview_engine(compiled.config)
    assert preview.plan == compiled.plan and preview.max_model_len == compiled.max_model_len
    model_key = keyed_model(preview.source, preview.config, preview.attn_backend)
    path = entry_for_plan(preview.plan.to_dict(), model_key, preview.config.dtype, preview.device)
    assert path == compiled.boot.compile_cache.path and is_sealed(path)
    # another attention backend is another entry: a trace saved under one fails the other's
    # guards (its metadata type) and would be traced again at every boot
    reference = TorchPagedAttentionBackend(torch.float32)
    other = keyed_model(preview.source, preview.config, reference)
    assert (
        entry_for_plan(preview.plan.to_dict(), other, preview.config.dtype, preview.device) != path
    )


def test_boundaries_are_checked_in_debug_mode(engines):
    _, compiled = engines
    children = list(compiled.runner.compile_backend.last_graph.children())
    pieces = [c for c in children if isinstance(c, _Piece)]
    splits = [c for c in children if isinstance(c, _SplitCall)]
    assert len(pieces) + len(splits) == len(children) and all(p.check for p in pieces)
    assert len(splits) == compiled.model_config.num_layers
    with pytest.raises(ContiguityError, match="strided view crossed a split boundary"):
        _check_contiguous("submod_1", "input", (torch.ones(4, 6).t(),))
    _check_contiguous("submod_1", "input", (torch.ones(4, 6), torch.ones(0)))


def test_the_dump_shows_every_piece_and_its_code(engines):
    """debug_dump_path: the traced graph, the split graph, an index of the pieces, and the code
    Inductor generated for each compiled piece (none for the splitting ops)."""
    _, compiled = engines
    (out,) = Path(compiled.plan.requested.debug_dump_path).iterdir()  # one compilation
    assert out.name == "compilation_0"
    layers = compiled.model_config.num_layers
    split_graph = (out / "split_graph.py").read_text()
    assert split_graph.count("= torch.ops.kiln.cpu_paged_attention(") == layers
    assert "cpu_paged_attention" in (out / "dynamo_graph.py").read_text()
    index = (out / "pieces.txt").read_text().splitlines()[1:]
    eager_rows = [row for row in index if row.split()[1:4] == ["splitting", "op", "eager"]]
    compiled_rows = [row for row in index if row.split()[1:3] == ["piece", "inductor"]]
    assert (len(eager_rows), len(compiled_rows)) == (layers, layers + 1)
    assert len(index) == 2 * layers + 1  # nothing else
    assert "float32[u1, 64] stride [64, 1]" in compiled_rows[1]  # tokens: a symbolic size
    codes = sorted(out.glob("*.inductor.py"))
    assert [c.name.split(".")[0] for c in codes] == sorted(r.split()[0] for r in compiled_rows)
    assert all("def call(" in c.read_text() for c in codes)
    assert all("assert_size_stride(" in c.read_text() for c in codes)  # Inductor's default
    # the linears (qkv, o, gate_up, down per dense layer; qkv, o and the router per sparse
    # one) call oneDNN from the generated code, not kiln's op (which would go back through
    # Python): kiln/compiler/lowerings.py
    text = "".join(c.read_text() for c in codes)
    sparse = len(compiled.model_config.sparse_layers)
    linears = 4 * (layers - sparse) + 3 * sparse
    assert text.count("= torch.ops.mkldnn._linear_pointwise.default(") == linears
    assert "= torch.ops.kiln.onednn_linear.default(" not in text
    # the experts run as one opaque op per sparse layer, inside a compiled piece, called
    # directly where this torch lets kiln say so (kiln/compiler/direct_calls.py)
    direct = register_direct_calls()
    call = "extern_kernels.kiln_moe_experts(" if direct else "torch.ops.kiln.moe_experts.default("
    assert text.count(call) == sparse
    assert "torch.ops.kiln.moe_experts.default(" not in text or not direct


def test_the_onednn_lowering_replaces_inductor_default_fallback(monkeypatch):
    """Where Inductor compiled kiln's linear op before kiln's backend ran (a torch.compile of
    the user's own), its lowerings table holds the default fallback, which calls the op's
    Python implementation: registering replaces it, and the code calls oneDNN directly."""
    from torch._inductor import lowering
    from torch._inductor.utils import run_and_get_code

    from kiln.compiler.lowerings import register_inductor_lowerings
    from kiln.layers.linear import Linear

    op = torch.ops.kiln.onednn_linear.default
    default = lowering.fallback_handler(op, add_to_fallback_set=False)
    monkeypatch.setitem(lowering.lowerings, op, default)
    register_inductor_lowerings()
    assert lowering.lowerings[op] is not default
    register_inductor_lowerings()  # idempotent: ours stays
    ours = lowering.lowerings[op]
    register_inductor_lowerings()
    assert lowering.lowerings[op] is ours

    layer = Linear(64, 96, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(5, 64)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    layer.finalize(torch.device("cpu"))
    if layer.layout != "onednn":
        pytest.skip("this torch build has no oneDNN")
    with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
        out, (code,) = run_and_get_code(torch.compile(layer, dynamic=True), x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert "= torch.ops.mkldnn._linear_pointwise.default(" in code
    assert "torch.ops.kiln.onednn_linear.default(" not in code


def test_inductor_options_reach_inductor(tiny_models, tmp_path):
    """inductor_compile_config is applied to every piece: with size_asserts off, the generated
    code has no input stride asserts (which the default keeps, above)."""
    config = dataclasses.replace(
        COMPILED,
        inductor_compile_config={"size_asserts": False},
        debug_dump_path=str(tmp_path),
    )
    path = tiny_models["llama"]
    compiled = make_engine(path, block_size=4, max_num_batched_tokens=16, compilation=config)
    assert compiled.plan.inductor_options == (("size_asserts", False),)
    _assert_matches_eager(make_engine(path, block_size=4, max_num_batched_tokens=16), compiled)
    codes = list(tmp_path.glob("compilation_0/*.inductor.py"))
    assert len(codes) == compiled.model_config.num_layers + 1
    assert not any("assert_size_stride(" in c.read_text() for c in codes)


class _CountingPass(CustomGraphPass):
    """A post-grad pass that changes nothing and counts the graphs Inductor gives it."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs += 1

    def uuid(self) -> str:
        return "kiln-tests-counting-pass-1"


def test_a_custom_graph_pass_runs_and_its_compilation_is_reused(tiny_models, tmp_path, monkeypatch):
    """A graph pass from the Python API runs on every Inductor piece, and a later engine
    given another instance of it (same uuid) reuses the entry and the compiled pieces: the
    pass does not run again. Keyed by address, each instance would have its own entry."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))  # a new entry: the pieces compile
    path = tiny_models["llama"]
    passes = [_CountingPass(), _CountingPass()]
    compiled = []
    for pass_ in passes:
        options = {"post_grad_custom_post_pass": pass_}
        config = dataclasses.replace(COMPILED, inductor_compile_config=options)
        compiled.append(
            make_engine(path, block_size=4, max_num_batched_tokens=16, compilation=config)
        )
    pieces = compiled[0].model_config.num_layers + 1
    assert [p.graphs for p in passes] == [pieces, 0]
    assert [e.boot.compile_cache.reused for e in compiled] == [False, True]
    assert compiled[1].boot.compile_cache.path == compiled[0].boot.compile_cache.path
    _assert_matches_eager(make_engine(path, block_size=4, max_num_batched_tokens=16), compiled[1])
    assert passes[1].graphs == 0


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_backends_without_inductor_match_eager(tiny_models, tmp_path, backend, caplog):
    """vLLM's `backend: eager` bisects a compiled-mode problem: Dynamo and the split, without
    Inductor (aot_eager: with AOTAutograd). The pieces run uncompiled, with eager's results."""
    config = dataclasses.replace(COMPILED, backend=backend, debug_dump_path=str(tmp_path))
    path = tiny_models["llama"]
    with caplog.at_level(logging.INFO, logger="kiln.boot"):
        compiled = make_engine(path, block_size=4, max_num_batched_tokens=16, compilation=config)
    assert compiled.plan.backend == backend and "piece backend" in plan_table(compiled.plan)
    _assert_matches_eager(make_engine(path, block_size=4, max_num_batched_tokens=16), compiled)
    stats = compiled.runner.compile_backend.stats
    assert (stats.compilations, stats.pieces) == (1, compiled.model_config.num_layers + 1)
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("torch.compile:")]
    entry = "reused" if compiled.boot.compile_cache.reused else "new"
    assert told == [f"torch.compile: {stats.summary(backend)} (compile cache {entry})"]
    assert f"1 graph, 3 pieces ({backend}) in " in told[0]
    index = (tmp_path / "compilation_0" / "pieces.txt").read_text()
    assert f"piece          {backend}" in index and not list(tmp_path.glob("*/*.inductor.py"))
    inductor_files = [
        p for p in (compiled.boot.compile_cache.path / "inductor").rglob("*") if p.is_file()
    ]
    assert not inductor_files  # nothing was compiled by Inductor into the entry


def test_unsplit_compile_matches_eager_and_owns_its_caches(tiny_models):
    """splitting_ops [] keeps the attention op inside one Inductor graph, which mutates the KV
    caches. Each cache must be its own tensor: as views of one shared buffer, Inductor copied
    the whole buffer every step (8.6 s per decode step of the embedded model)."""
    path = tiny_models["llama"]
    eager = make_engine(path, block_size=4, max_num_batched_tokens=16)
    whole = make_engine(
        path,
        block_size=4,
        max_num_batched_tokens=16,
        compilation=CompilationConfig(mode=3, splitting_ops=()),
    )
    caches = [t for pair in whole.runner.kv_caches for t in pair]
    assert len(caches) == 2 * whole.model_config.num_layers
    assert all(t._base is None for t in caches)
    assert len({t.untyped_storage().data_ptr() for t in caches}) == len(caches)
    _assert_matches_eager(eager, whole)
    stats = whole.runner.compile_backend.stats
    assert (stats.pieces, stats.splitting_op_calls, stats.compilations) == (1, 0, 1)


def test_recompilation_is_counted_and_warned(tiny_models, caplog, monkeypatch):
    """Also: Dynamo drops its guards on the model's constants only (model_guard_filter): the
    weights and the module structure go, the guards on the inputs and the KV caches stay, which
    is what makes the recompilation below happen."""
    seen: list[tuple[object, bool]] = []

    def recording_filter(guards):
        keep = model_guard_filter(guards)
        seen.extend(zip(guards, keep))
        return keep

    monkeypatch.setattr("kiln.compiler.precompile.model_guard_filter", recording_filter)
    # Dynamo traces at every boot without a saved trace (test_precompile.py: with one)
    config = CompilationConfig(mode=3, splitting_ops=SPLIT, aot_compile=False)
    engine = make_engine(tiny_models["llama"], compilation=config)
    tensors = [(g, keep) for g, keep in seen if g.guard_type == "TENSOR_MATCH"]
    is_weight = [isinstance(g.value, torch.nn.Parameter) for g, _ in tensors]
    assert sum(is_weight) >= 4 * engine.model_config.num_layers  # norms, qkv, o, mlp
    assert [keep for _, keep in tensors] == [not w for w in is_weight]
    caches = {id(t) for pair in engine.runner.kv_caches for t in pair}
    assert sum(keep and id(g.value) in caches for g, keep in tensors) == len(caches)
    on_model = [re.match(r"(L\['self'\]|self)($|[.\[])", g.name) is not None for g, _ in seen]
    assert all(keep for (_, keep), m in zip(seen, on_model) if not m)  # inputs, globals
    dropped = {g.guard_type for (g, keep), m in zip(seen, on_model) if m and not keep}
    assert {"TYPE_MATCH", "EQUALS_MATCH", "TENSOR_MATCH"} <= dropped
    with caplog.at_level(logging.WARNING):
        forward_with_int32_positions(engine)
    assert engine.runner.recompilations == 1
    assert engine.stats().graphs["recompilations"] == 1
    (warning,) = [r.getMessage() for r in caplog.records if "recompiled" in r.getMessage()]
    reason = engine.stats().graphs["last_recompile_reason"]
    assert "tensor 'positions'" in reason  # the guard that failed, named
    assert reason in warning and "TORCH_LOGS=recompiles_verbose" in warning


def test_bf16_compiled_matches_bf16_eager(tiny_models):
    """bf16 on the CPU: oneDNN's bf16 weights through the compiled graph (the CPU default, one
    unsplit graph) give eager's greedy tokens, logits within a few bf16 roundings."""
    path = tiny_models["llama"]
    kwargs = dict(block_size=4, max_num_batched_tokens=16, dtype="bfloat16")
    eager = make_engine(path, **kwargs)
    compiled = make_engine(path, **kwargs, compilation=CompilationConfig(mode=3, splitting_ops=()))
    _assert_matches_eager(eager, compiled, rtol=0, atol=4 * 2**-8, near_ties=True)  # bf16


def test_engines_never_share_compiled_code(tiny_models):
    """model_guard_filter drops the guards that tell two models of one class apart; what keeps
    an engine from running another engine's compiled forward is Dynamo's backend match (each
    engine compiles with its own SplitBackend), so each engine must compile its own."""
    config = CompilationConfig(mode=3, splitting_ops=SPLIT)
    first = make_engine(tiny_models["llama"], compilation=config)
    second = make_engine(tiny_models["llama"], compilation=config)
    third = make_engine(tiny_models["qwen3"], compilation=config)  # same class, other layers
    for engine in (first, second, third):
        assert engine.runner.compile_backend.stats.compilations >= 1
    _assert_matches_eager(make_engine(tiny_models["qwen3"]), third)


def test_a_process_compiles_engine_after_engine(tiny_models):
    """Each engine compiles a forward with a code object of its own: on the one code object
    of CausalLM.forward the ninth compiled engine of a process failed with
    FailOnRecompileLimitHit (Dynamo's recompile_limit, 8). This suite runs at the default
    limit, dozens of compiled engines in one process."""
    import kiln.models.llama
    from kiln import LLM

    assert torch._dynamo.config.recompile_limit == 8  # torch's default: nothing raised it
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outputs, codes = [], []  # the code objects kept alive, so that no id is reused
    config = {"mode": 3}
    for _ in range(10):
        with LLM(tiny_models["llama"], compilation_config=config, kv_cache_memory="4MiB") as llm:
            outputs.append(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids)
            backend = llm.engine.runner.compile_backend
            assert backend.stats.compilations == 1 and backend.stats.recompilations == 0
            codes.append(backend.traced_code)
    assert all(out == outputs[0] for out in outputs)
    shared = kiln.models.llama.CausalLM.forward.__code__
    assert len({id(c) for c in codes}) == 10 and all(c is not shared for c in codes)


def test_embedded_model_compiled_matches_eager(smollm_llm):
    """The default (packed) embedded model compiled: each step's logits equal eager's within
    bf16 noise (the packed linears round to bf16, so Inductor's float32 reassociations can move
    a logit by an ulp of bf16), and the known answer."""
    from kiln import LLM

    compiled = LLM(
        kv_cache_memory="256MiB", max_model_len=2048, max_num_seqs=8, compilation_config={"mode": 3}
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tok = smollm_llm.tokenizer
    conversations = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                   add_special_tokens=False)
        for q in ("What is the capital of France?", "What is 1 + 1?", "Name a color.")
    ]  # fmt: skip
    arrivals = [(0, ids, params) for ids in conversations]
    _, ours_logits = run_schedule(compiled.engine, arrivals, record_logits=True)
    ref, ref_logits = run_schedule(smollm_llm.engine, arrivals, record_logits=True)
    for rid in ref:
        a, b = torch.stack(ours_logits[rid]).float(), torch.stack(ref_logits[rid]).float()
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=2**-6 * b[0].abs().max().item())
    answer = compiled.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                           SamplingParams(temperature=0, max_tokens=24))  # fmt: skip
    assert "Paris" in answer[0].outputs[0].text
    assert compiled.engine.stats().graphs["recompilations"] == 0
    assert compiled.engine.plan.mode == 3
