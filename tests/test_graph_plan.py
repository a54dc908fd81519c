"""The graph plan: the design's rules row by row, properties over every combination of
requested mode x compilation mode x device x backend support x uniform token count, one
WARNING per change naming the remedy, and strict mode refusing instead."""

from __future__ import annotations

import itertools
import json
import logging

import pytest
from torch._inductor.custom_graph_pass import CustomGraphPass

from kiln.attention.backend import GraphSupport
from kiln.config.compilation import CompilationConfig
from kiln.config.compilation_values import CUDAGraphMode
from kiln.config.graph_plan import AttentionCaps, DeviceCaps, RuntimeMode, resolve_graph_plan
from kiln.config.plan_table import log_plan, plan_table
from kiln.config.vllm_fields import VLLM_ONLY
from kiln.cudagraphs.dispatcher import BatchDescriptor, describe, dispatch
from kiln.errors import ConfigError

M = CUDAGraphMode
R = RuntimeMode
S = GraphSupport
CUDA = DeviceCaps("cuda", True)
CPU = DeviceCaps.cpu()
OPS = ("kiln::attn",)


def plan(graph, mode=3, device=CUDA, support=S.UNIFORM_BATCH, q=1, strict=False, **kw):
    return resolve_graph_plan(
        CompilationConfig(mode=mode, cudagraph_mode=graph, **kw),
        device,
        AttentionCaps("attn", support, OPS),
        max_num_batched_tokens=256,
        max_num_seqs=64,
        uniform_decode_query_len=q,
        strict=strict,
    )


@pytest.mark.parametrize(
    "graph,mode,device,support,q,expected",
    [
        # the classic silent fallback: PIECEWISE under mode 0 became NONE at INFO level
        (M.PIECEWISE, 0, CUDA, S.ALWAYS, 1, M.NONE),
        # ... and F&P under mode 0 keeps its FULL decode graphs
        (M.FULL_AND_PIECEWISE, 0, CUDA, S.UNIFORM_BATCH, 1, M.FULL_DECODE_ONLY),
        # FULL with a backend that cannot run mixed batches in a graph
        (M.FULL, 3, CUDA, S.UNIFORM_BATCH, 1, M.FULL_AND_PIECEWISE),
        (M.FULL, 0, CUDA, S.UNIFORM_BATCH, 1, M.FULL_DECODE_ONLY),
        (M.FULL, 3, CUDA, S.NEVER, 1, M.PIECEWISE),
        (M.FULL, 0, CUDA, S.NEVER, 1, M.NONE),
        (M.FULL, 3, CUDA, S.ALWAYS, 1, M.FULL),
        (M.FULL, 0, CUDA, S.ALWAYS, 3, M.FULL),
        # single-token-decode backends cannot capture MTP's 1 + k token decode
        (M.FULL_AND_PIECEWISE, 3, CUDA, S.UNIFORM_SINGLE_TOKEN_DECODE, 3, M.PIECEWISE),
        (M.FULL_DECODE_ONLY, 3, CUDA, S.UNIFORM_SINGLE_TOKEN_DECODE, 3, M.NONE),
        (M.FULL_AND_PIECEWISE, 3, CUDA, S.UNIFORM_SINGLE_TOKEN_DECODE, 1, M.FULL_AND_PIECEWISE),
        (M.FULL_AND_PIECEWISE, 3, CUDA, S.UNIFORM_BATCH, 3, M.FULL_AND_PIECEWISE),
        # no CUDA graphs on the CPU; mode 3 stays
        (M.FULL_AND_PIECEWISE, 3, CPU, S.ALWAYS, 1, M.NONE),
        (M.PIECEWISE, 3, CPU, S.NEVER, 1, M.NONE),
    ],
)
def test_rules(graph, mode, device, support, q, expected):
    p = plan(graph, mode, device, support, q)
    assert p.cudagraph_mode is expected
    assert p.mode == mode
    assert bool(p.changes) == (expected is not graph)


DEVICES = [CUDA, CPU]
COMBOS = list(itertools.product(list(M), [0, 3], DEVICES, list(S), [1, 3]))


@pytest.mark.parametrize("graph,mode,device,support,q", COMBOS)
def test_every_combination(graph, mode, device, support, q, caplog):
    p = plan(graph, mode, device, support, q)
    decode, mixed = p.decode_mode, p.mixed_mode
    if not device.cuda_graphs:
        assert (decode, mixed) == (R.NONE, R.NONE)
    if mode == 0:
        assert R.PIECEWISE not in (decode, mixed)
    if decode is R.FULL:
        assert (
            support is S.ALWAYS
            or support is S.UNIFORM_BATCH
            or (support is S.UNIFORM_SINGLE_TOKEN_DECODE and q == 1)
        )
    if mixed is R.FULL:
        assert support is S.ALWAYS
    if decode is not R.NONE:
        assert p.decode_capture_sizes and all(s % q == 0 for s in p.decode_capture_sizes)
    assert all(s <= 256 for s in p.decode_capture_sizes + p.mixed_capture_sizes)
    assert (p.cudagraph_mode is graph) == (not p.changes)
    with caplog.at_level(logging.INFO):
        log_plan(p, logging.getLogger("test"))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(p.changes)
    assert all("Remedy:" in r.getMessage() for r in warnings)
    if p.changes:
        with pytest.raises(ConfigError, match="--strict-graphs") as info:
            plan(graph, mode, device, support, q, strict=True)
        assert "Remedy" in str(info.value) and graph.value in str(info.value)
    else:
        assert plan(graph, mode, device, support, q, strict=True) == p


def test_capture_sizes_are_cut_and_rounded_loudly():
    p = plan(M.FULL_AND_PIECEWISE, q=3, cudagraph_capture_sizes=(1, 2, 4, 8, 300, 512))
    assert p.mixed_capture_sizes == (1, 2, 4, 8)  # 300, 512 exceed the 256-token budget
    assert p.decode_capture_sizes == (3, 6, 9)  # rounded up to multiples of 3
    reasons = " ".join(c.reason for c in p.changes)
    assert "[300, 512]" in " ".join(c.requested for c in p.changes)
    assert "multiples" in reasons and "budget" in reasons
    with pytest.raises(ConfigError):
        plan(M.FULL_AND_PIECEWISE, q=3, cudagraph_capture_sizes=(5,), strict=True)


def test_defaults_need_no_warning():
    cpu = resolve_graph_plan(
        CompilationConfig(),
        CPU,
        AttentionCaps("attn", S.NEVER, OPS),
        max_num_batched_tokens=2048,
        max_num_seqs=64,
    )
    assert (cpu.mode, cpu.cudagraph_mode, cpu.changes) == (0, M.NONE, ())
    gpu = resolve_graph_plan(
        CompilationConfig(),
        CUDA,
        AttentionCaps("attn", S.UNIFORM_BATCH, OPS),
        max_num_batched_tokens=2048,
        max_num_seqs=64,
    )
    assert (gpu.mode, gpu.cudagraph_mode) == (3, M.FULL_AND_PIECEWISE)
    assert gpu.decode_capture_sizes[:4] == (1, 2, 4, 8) and gpu.mixed_capture_sizes[-1] == 512


def test_enforce_eager_and_splitting_ops():
    p = resolve_graph_plan(
        CompilationConfig(mode=3, cudagraph_mode=M.PIECEWISE),
        CUDA,
        AttentionCaps("attn", S.NEVER, OPS),
        max_num_batched_tokens=64,
        max_num_seqs=8,
        enforce_eager=True,
    )
    assert (p.mode, p.cudagraph_mode) == (0, M.NONE) and len(p.changes) == 2
    p = plan(M.PIECEWISE, support=S.NEVER, splitting_ops=())
    assert p.cudagraph_mode is M.NONE and "splitting_ops" in p.changes[0].reason


@pytest.mark.parametrize(
    ("graph", "device", "support", "splits"),
    [
        (M.NONE, CPU, S.NEVER, ()),  # nothing replays pieces: one Inductor graph
        (M.FULL_AND_PIECEWISE, CPU, S.NEVER, ()),  # resolved to NONE on the CPU
        (M.FULL, CUDA, S.ALWAYS, ()),
        (M.FULL_DECODE_ONLY, CUDA, S.ALWAYS, ()),
        (M.PIECEWISE, CUDA, S.NEVER, OPS),
        (M.FULL_AND_PIECEWISE, CUDA, S.ALWAYS, OPS),
        (M.FULL, CUDA, S.UNIFORM_BATCH, OPS),  # resolved to FULL_AND_PIECEWISE
    ],
)
def test_default_splitting_follows_the_piecewise_graphs(graph, device, support, splits):
    p = plan(graph, device=device, support=support)
    assert p.splitting_ops == splits
    assert ("one Inductor graph" in plan_table(p)) == (not splits)
    explicit = plan(graph, device=device, support=support, splitting_ops=OPS)
    assert explicit.splitting_ops == OPS  # asked for, kept


def test_splitting_ops_in_vllm_spelling_and_unknown_ops(tiny_models):
    """vLLM's "namespace.op" spelling means the same op; a name that is no registered op is an
    error naming kiln's attention ops, not a split that silently never happens."""
    from kiln.compiler.split_backend import check_splitting_ops
    from tests.helpers import make_engine

    dotted = CompilationConfig(splitting_ops=["kiln.torch_paged_attention"])
    assert dotted.splitting_ops == ("kiln::torch_paged_attention",)
    p = plan(M.PIECEWISE, support=S.NEVER, splitting_ops=["kiln.attn"])
    assert p.cudagraph_mode is M.PIECEWISE and not p.changes
    known = ("kiln::torch_paged_attention", "kiln::triton_paged_attention")
    check_splitting_ops(["kiln.triton_paged_attention", "aten::mm"], known)
    with pytest.raises(ConfigError, match="'kiln::attention', which is not a registered op"):
        make_engine(
            tiny_models["llama"],
            compilation=CompilationConfig(mode=3, splitting_ops=["kiln::attention"]),
        )
    with pytest.raises(ConfigError, match="kiln::torch_paged_attention, kiln::triton_paged"):
        check_splitting_ops(["nosuchns.op"], known)


def test_config_parsing_errors():
    assert CompilationConfig.from_json(
        '{"mode": 3, "cudagraph_mode": "piecewise"}'
    ) == CompilationConfig(mode=3, cudagraph_mode=M.PIECEWISE)
    assert CompilationConfig.from_json("3").mode == 3
    for bad, words in [
        ('{"mode": 2}', "mode 2"),
        ('{"cudagraph_mode": "HALF"}', "HALF"),
        ('{"moed": 3}', "moed"),
        ("{mode: 3}", "JSON"),
        ('{"cudagraph_capture_sizes": [0]}', ">= 1"),
        ("[3]", "object"),
        # JSON true is a Python int: it must not pass for mode 1 or a capture size of 1
        ('{"mode": true}', "as a number or vLLM's names"),
        ('{"cudagraph_capture_sizes": [true, 2]}', "list of integers"),
        ('{"max_cudagraph_capture_size": true}', "integer >= 1"),
        # a lone value where a list belongs (iterated, a string was read letter by letter)
        ('{"cudagraph_capture_sizes": 4}', r"e.g. \[1, 2, 4, 8\], got 4"),
        ('{"splitting_ops": "kiln.torch_paged_attention"}', "must be a list of op names"),
        ('{"splitting_ops": 5}', "must be a list of op names"),
        ('{"debug_contiguity": "yes"}', "true or false"),
        ('{"mode": "STOCK_TORCH_COMPILE"}', "vLLM's STOCK_TORCH_COMPILE"),
        ('{"mode": "3"}', "as a number or vLLM's names"),
        ('{"level": 3, "mode": 0}', "keep only mode"),
        ('{"backend": "cudagraphs"}', 'compiles the pieces with "inductor"'),
        ('{"inductor_compile_config": {"max_autotun": true}}', "did you mean max_autotune"),
        ('{"inductor_compile_config": {"max_autotune": 1}}', "takes true or false"),
        ('{"inductor_compile_config": {"cpp.threads": "4"}}', "takes an integer"),
        ('{"inductor_compile_config": "max_autotune"}', "an object of Inductor options"),
        ('{"debug_dump_path": ""}', "a directory path"),
    ]:
        with pytest.raises(ConfigError, match=words):
            CompilationConfig.from_json(bad)


def test_an_inductor_option_the_cache_key_cannot_name_is_refused():
    """A Python object among the Inductor options (a custom graph pass, from the Python API)
    must name its version with uuid(), as torch's CustomGraphPass does: the compile cache key
    holds it, and anything else would print as an address, a new key in every process. Each
    refusal says what it got and the remedy; a pass with a uuid is accepted and shown by it."""

    class Versioned(CustomGraphPass):
        def __init__(self, version):
            self.version = version

        def __call__(self, graph):
            pass

        def uuid(self):
            if isinstance(self.version, Exception):
                raise self.version
            return self.version

    def a_function(graph):
        pass

    remedy = "Remedy: make it a torch._inductor.custom_graph_pass.CustomGraphPass whose uuid()"
    for value, words in [
        (a_function, "<locals>.a_function, which the compile cache key cannot name"),
        (object(), "is a value of type object, which"),
        (Versioned, "is the class test_an_inductor_option"),
        (Versioned(None), "whose uuid() returned None"),
        ([1, Versioned(None)], "whose uuid() returned None"),
    ]:
        with pytest.raises(ConfigError) as err:
            CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": value})
        assert words in str(err.value) and remedy in str(err.value)
    with pytest.raises(ConfigError, match=r"uuid\(\) raised ValueError: no version"):
        failing = Versioned(ValueError("no version"))
        CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": failing})
    p = plan(M.NONE, inductor_compile_config={"post_grad_custom_post_pass": Versioned(b"\x01")})
    shown = f"{__name__}.{Versioned.__qualname__}(uuid=b'\\x01')"
    assert p.to_dict()["inductor_compile_config"] == {"post_grad_custom_post_pass": shown}
    assert f"post_grad_custom_post_pass={shown!r}" in plan_table(p)
    assert json.loads(json.dumps(p.to_dict()))["requested"]["inductor_compile_config"] == {
        "post_grad_custom_post_pass": shown
    }


def test_compiler_settings_resolve_and_unused_ones_are_told(caplog):
    """backend, inductor_compile_config and debug_dump_path: resolved into the plan, and each
    one that cannot take effect is a change naming the remedy (strict mode refuses it)."""
    options = {"size_asserts": False, "max_autotune": True}
    p = plan(M.PIECEWISE, inductor_compile_config=options, backend="")
    assert (p.backend, p.inductor_options, p.changes) == (
        "inductor",
        tuple(sorted(options.items())),
        (),
    )
    assert "size_asserts=False" in plan_table(p)
    assert p.to_dict()["inductor_compile_config"] == options
    assert plan(M.PIECEWISE, backend="EAGER").backend == "eager"
    # one graph by default where nothing replays pieces, but not under aot_eager, which would
    # copy the KV caches the attention op writes (nothing reinplaces it without Inductor)
    assert [plan(M.NONE, backend=b).splitting_ops for b in ("eager", "aot_eager")] == [(), OPS]
    nested = {"cpp": {"simdlen": 8}, "max_autotune": True}  # -O.inductor_compile_config.cpp.simdlen
    assert CompilationConfig(inductor_compile_config=nested).inductor_options == {
        "cpp.simdlen": 8,
        "max_autotune": True,
    }
    assert plan(M.NONE, mode=0, backend="inductor").changes == ()  # the default, spelt out
    cases = [
        (dict(mode=0, backend="eager"), "backend", "mode 0 compiles nothing", '"mode": 3'),
        (dict(mode=0, debug_dump_path="/tmp/d"), "debug_dump_path", "mode 0", '"mode": 3'),
        (dict(mode=0, inductor_compile_config=options), "inductor_compile_config", "mode 0", "3"),
        (
            dict(backend="aot_eager", inductor_compile_config=options),
            "inductor_compile_config",
            "backend aot_eager does not run Inductor",
            'drop "backend"',
        ),
    ]
    for kw, name, reason, remedy in cases:
        p = plan(M.NONE, **kw)
        (change,) = p.changes
        assert (change.field, change.resolved) == (name, "(unused)")
        assert reason in change.reason and remedy in change.remedy
        assert p.inductor_options == () and (p.backend is None) == (p.mode == 0)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            log_plan(p, logging.getLogger("test"))
        assert [r.getMessage() for r in caplog.records] == [f"graph plan: {change.message()}"]
        with pytest.raises(ConfigError, match=f"(?s)--strict-graphs.*  - {name} "):
            plan(M.NONE, strict=True, **kw)


def test_an_unused_compiler_setting_under_enforce_eager_names_the_flag():
    p = resolve_graph_plan(
        CompilationConfig(mode=3, backend="eager"),
        CUDA,
        AttentionCaps("attn", S.ALWAYS, OPS),
        max_num_batched_tokens=64,
        max_num_seqs=8,
        enforce_eager=True,
    )
    (change,) = [c for c in p.changes if c.field == "backend"]
    assert "(--enforce-eager)" in change.reason and change.remedy == "drop --enforce-eager"


def test_vllm_spellings_of_the_mode_carry_over(caplog):
    """Launchers written for vLLM pass its mode names, its pre-v0.11 field `level`, or a bare
    integer through the Python API."""
    for spelling, mode in [("VLLM_COMPILE", 3), ("none", 0), ("NO_COMPILATION", 0)]:
        assert CompilationConfig(mode=spelling).mode == mode
    assert CompilationConfig.from_json(3) == CompilationConfig(mode=3)
    with caplog.at_level(logging.WARNING):
        assert CompilationConfig.from_json('{"level": 3}') == CompilationConfig(mode=3)
        assert CompilationConfig.from_json({"level": "PIECEWISE", "mode": 3}).mode == 3
    assert caplog.text.count("'level' is vLLM's old spelling") == 2
    with caplog.at_level(logging.WARNING):
        assert CompilationConfig.from_json({"use_inductor": False}).backend == "eager"
        assert CompilationConfig.from_json({"use_inductor": True, "backend": ""}).backend == (
            "inductor"
        )
    assert caplog.text.count('use_inductor false as "backend": "eager"') == 1
    with pytest.raises(ConfigError, match="keep only backend"):
        CompilationConfig.from_json({"use_inductor": False, "backend": "inductor"})
    with pytest.raises(ConfigError, match="use_inductor must be true or false"):
        CompilationConfig.from_json({"use_inductor": 0})


# vLLM's settings for machinery kiln lacks, each asking for something
VLLM_ONLY_ASKING = {
    "cache_dir": "/srv/compile",
    "compile_cache_save_format": "binary",
    "compile_sizes": [1, 2, 4],
    "compile_ranges_split_points": [8],
    "custom_ops": ["none", "+rms_norm"],
    "pass_config": {"fuse_norm_quant": True},
    "inductor_passes": {"my_pass": "pkg.module.my_pass"},
    "use_inductor_graph_partition": True,
    "dynamic_shapes_config": {"type": "backed"},
    "cudagraph_num_of_warmups": 2,
    "compile_mm_encoder": True,
}
# ... and at values that ask for nothing: vLLM's defaults, or what kiln does anyway
VLLM_ONLY_QUIET = {
    "cache_dir": "",
    "compile_sizes": [],
    "custom_ops": [],
    "pass_config": {},
    "use_inductor_graph_partition": False,
    "dynamic_shapes_config": {"type": "unbacked"},
    "cudagraph_num_of_warmups": 0,
    "cudagraph_copy_inputs": True,  # kiln's runner copies every step's inputs anyway
    "cudagraph_specialize_lora": True,  # no LoRA: no effect in vLLM either
    "compile_mm_encoder": False,
}


def _resolve(config: CompilationConfig, strict: bool = False):
    attention = AttentionCaps("attn", S.UNIFORM_BATCH, OPS)
    return resolve_graph_plan(
        config, CUDA, attention, max_num_batched_tokens=64, max_num_seqs=8, strict=strict
    )


def test_vllm_fields_without_kiln_machinery_boot_and_are_told(caplog):
    """A vLLM launcher's settings for what kiln lacks: accepted, and each one that asks for
    something is an unused setting with its reason (one WARNING each; strict refuses)."""
    assert set(VLLM_ONLY_ASKING) | set(VLLM_ONLY_QUIET) == set(VLLM_ONLY)
    config = CompilationConfig.from_json(json.dumps({"mode": 3, **VLLM_ONLY_ASKING}))
    assert config.mode == 3 and dict(config.vllm_only) == VLLM_ONLY_ASKING
    p = _resolve(config)
    assert [c.field for c in p.changes] == sorted(VLLM_ONLY_ASKING)
    for change in p.changes:
        assert change.resolved == "(unused)"
        assert change.reason == VLLM_ONLY[change.field].reason
        assert json.loads(change.requested) == VLLM_ONLY_ASKING[change.field]
    assert "KILN_CACHE_DIR" in next(c.remedy for c in p.changes if c.field == "cache_dir")
    with caplog.at_level(logging.WARNING):
        log_plan(p, logging.getLogger("test"))
    assert len(caplog.records) == len(VLLM_ONLY_ASKING)
    with pytest.raises(ConfigError, match=r"(?s)--strict-graphs.*  - compile_sizes "):
        _resolve(config, strict=True)
    quiet = CompilationConfig.from_json({"mode": 3, **VLLM_ONLY_QUIET})
    assert _resolve(quiet, strict=True).changes == ()
    assert p.to_dict()["requested"]["vllm_only"] == VLLM_ONLY_ASKING
    # the compile cache key is the resolved plan's: settings that change nothing key nothing
    assert _resolve(quiet).to_dict() | {"requested": None, "changes": None} == (
        p.to_dict() | {"requested": None, "changes": None}
    )


def test_vllm_cuda_graph_switches_and_values_carry_over(caplog):
    """vLLM's enum values for cudagraph_mode, and its pre-v0.11 switches read as the mode they
    meant (with a warning naming the current spelling); a contradiction is an error."""
    for value, mode in [(0, M.NONE), (1, M.PIECEWISE), (2, M.FULL), ([2, 0], M.FULL_DECODE_ONLY)]:
        assert CompilationConfig.from_json({"cudagraph_mode": value}).cudagraph_mode is mode
    assert CompilationConfig(cudagraph_mode=[2, 1]).cudagraph_mode is M.FULL_AND_PIECEWISE
    with caplog.at_level(logging.WARNING):
        assert CompilationConfig.from_json({"use_cudagraph": False}).cudagraph_mode is M.NONE
        assert CompilationConfig.from_json({"full_cuda_graph": True}).cudagraph_mode is M.FULL
        both = {"full_cuda_graph": True, "cudagraph_mode": 2}
        assert CompilationConfig.from_json(both).cudagraph_mode is M.FULL
    assert caplog.text.count('as "cudagraph_mode": ') == 3
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # vLLM's defaults ask for nothing: no warning
        defaults = {"use_cudagraph": True, "full_cuda_graph": False}
        assert CompilationConfig.from_json(defaults) == CompilationConfig()
    assert caplog.records == []
    for bad, words in [
        ({"use_cudagraph": False, "cudagraph_mode": "FULL"}, "keep only cudagraph_mode"),
        ({"full_cuda_graph": True, "cudagraph_mode": "PIECEWISE"}, "keep only cudagraph_mode"),
        ({"full_cuda_graph": "yes"}, "full_cuda_graph must be true or false"),
        ({"use_cudagraph": False, "full_cuda_graph": True}, r"\(FULL graphs\): keep only"),
        ({"cudagraph_mode": True}, r"vLLM's values 0, 1, 2"),
        ({"cudagraph_mode": [2, 2]}, r"vLLM's values 0, 1, 2"),
        ({"cudagraph_modes": "FULL"}, "did you mean 'cudagraph_mode'"),
        ({"compile_size": [1]}, "did you mean 'compile_sizes'"),
    ]:
        with pytest.raises(ConfigError, match=words):
            CompilationConfig.from_json(bad)


def test_dispatcher():
    p = plan(M.FULL_AND_PIECEWISE, cudagraph_capture_sizes=(1, 2, 4, 8, 16))
    d = dispatch(p, describe([1, 1, 1]))
    assert (d.mode, d.descriptor.num_tokens, d.promised) == (R.FULL, 4, True)
    d = dispatch(p, describe([1, 4]))
    assert (d.mode, d.descriptor.num_tokens) == (R.PIECEWISE, 8)
    d = dispatch(p, describe([40]))
    assert (d.mode, d.promised) == (R.NONE, False)  # above the ladder: eager by design
    mtp = plan(M.FULL_AND_PIECEWISE, q=3, cudagraph_capture_sizes=(3, 6, 12))
    d = dispatch(mtp, describe([3, 3]))
    assert (d.mode, d.descriptor) == (R.FULL, BatchDescriptor(6, 2, 3))
    d = dispatch(mtp, describe([1, 1]))  # not uniform at 3 tokens: the mixed graphs
    assert d.mode is R.PIECEWISE


@pytest.mark.parametrize(
    ("support", "plain_decode"), [(S.ALWAYS, "FULL"), (S.UNIFORM_BATCH, "NONE")]
)
def test_speculative_decode_graphs_take_single_token_decodes_where_the_backend_can(
    support, plain_decode
):
    """With 1 + k = 4 tokens per verified sequence, the FULL decode graphs replay a step that
    verifies nothing (1 token per request) only for a backend that runs any batch in a graph."""
    p = plan("FULL_DECODE_ONLY", mode=0, support=support, q=4)
    assert dispatch(p, describe([4] * 3)).mode.value == "FULL"
    assert dispatch(p, describe([1] * 5)).mode.value == plain_decode
    assert dispatch(p, describe([4, 1])).mode.value == "NONE"  # mixed: eager in this mode
