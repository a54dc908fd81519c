"""Dynamo's saved trace (kiln/compiler/precompile.py): the first compiled boot of a
configuration traces the forward and saves the trace in its compile cache entry, later boots
load it instead of tracing, with eager's outputs; another block size gets a trace of its own; a
loaded guard that fails falls back to Dynamo as a counted recompilation; an unreadable trace is
warned about and traced again; `"aot_compile": false` saves nothing."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

from kiln.compiler.split_backend import CompileStats
from kiln.config import CompilationConfig
from kiln.errors import ConfigError
from kiln.sampling_params import SamplingParams
from tests.helpers import forward_with_int32_positions, make_engine, run_schedule
from tests.test_compiled import _assert_matches_eager

COMPILED = CompilationConfig(mode=3)  # the CPU default: one Inductor graph


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """A compile cache of this module's own, so that its first engine is the first boot."""
    root = tmp_path_factory.mktemp("kiln_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama"]


def _engine(model, block_size: int = 4, config: CompilationConfig = COMPILED):
    return make_engine(model, block_size=block_size, max_num_batched_tokens=16, compilation=config)


def _traces(engine) -> list:
    return sorted((engine.boot.compile_cache.path / "dynamo").glob("forward-*.bin"))


@pytest.fixture(scope="module")
def first(cache_root, model):
    return _engine(model)


def test_the_first_boot_traces_and_saves_into_its_sealed_entry(first):
    stats = first.runner.compile_backend.stats
    assert not first.boot.compile_cache.reused
    assert stats.trace == "traced and saved" and stats.compilations == 1
    (trace,) = _traces(first)
    manifest = json.loads((first.boot.compile_cache.path / "manifest.json").read_text())
    # a corrupted trace is then a corrupted entry, rebuilt as any other (test_compile_cache)
    assert str(trace.relative_to(first.boot.compile_cache.path)) in manifest["files"]
    assert "Dynamo's trace (saved) and the first run" in stats.summary("inductor")


def test_a_later_boot_loads_the_trace_with_eager_outputs(first, model):
    second = _engine(model)
    stats = second.runner.compile_backend.stats
    assert second.boot.compile_cache.reused and _traces(second) == _traces(first)
    assert stats.trace == "loaded" and stats.trace_load_s > 0 and stats.compilations == 1
    assert second.runner.compile_stats()["dynamo_trace"] == "loaded"
    _assert_matches_eager(make_engine(model, block_size=4, max_num_batched_tokens=16), second)
    assert stats.compilations == 1 and stats.recompilations == 0  # every batch size: one trace
    assert "Dynamo's trace loaded and the first run" in stats.summary("inductor")


def test_another_block_size_gets_a_trace_of_its_own(first, model):
    """The trace specializes on the KV cache's block size and the input buffers' lengths,
    which the entry's key does not cover: such an engine traces and saves its own, beside."""
    other = _engine(model, block_size=8)
    assert other.boot.compile_cache.path == first.boot.compile_cache.path
    assert other.runner.compile_backend.stats.trace == "traced and saved"
    assert len(_traces(other)) == 2
    again = _engine(model, block_size=8)
    assert again.runner.compile_backend.stats.trace == "loaded"
    reference = make_engine(model, block_size=8, max_num_batched_tokens=16)
    _assert_matches_eager(reference, again)


def test_a_failed_guard_of_the_loaded_trace_is_a_counted_recompilation(first, model, caplog):
    engine = _engine(model)
    assert engine.runner.compile_backend.stats.trace == "loaded"
    with caplog.at_level(logging.WARNING):
        forward_with_int32_positions(engine)
    assert engine.runner.recompilations == 1
    reason = engine.stats().graphs["last_recompile_reason"]
    assert re.search(r"tensor 'L\['positions'\]'", reason)  # the loaded guard, named
    (warning,) = [r.getMessage() for r in caplog.records if "recompiled" in r.getMessage()]
    assert reason in warning
    # the fallback marked the KV caches dynamic for Dynamo; a step laid out as kiln lays it out
    # passes the loaded guards again (their marks, left on, failed them at every later step)
    runner = engine.runner
    with torch.inference_mode():
        args = runner.model_inputs(runner.prepare(engine.scheduler.schedule()).layout)
        assert runner.forward.saved.guard_check(runner.forward.model, *args)
    reference = make_engine(model, block_size=4, max_num_batched_tokens=16)
    _assert_matches_eager(reference, engine)
    assert engine.runner.recompilations == 1


def test_a_call_identical_to_one_that_passed_skips_the_guard_check(first, model, monkeypatch):
    """A decode stream calls the forward in the same few shapes step after step: each shape's
    guards are checked once and later identical calls skip the check (a new block in the
    table is a new shape), with eager's tokens."""
    engine = _engine(model)
    forward = engine.runner.forward
    checked, calls = [], []
    check, fn = forward.saved.guard_check, forward.saved.fn
    monkeypatch.setattr(forward.saved, "guard_check", lambda *a: checked.append(1) or check(*a))
    monkeypatch.setattr(forward.saved, "fn", lambda *a: calls.append(1) or fn(*a))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out, _ = run_schedule(engine, [(0, [5, 6, 7, 8, 9], params)])
    reference, _ = run_schedule(make_engine(model, block_size=4), [(0, [5, 6, 7, 8, 9], params)])
    assert out["0"].outputs[0].token_ids == reference["0"].outputs[0].token_ids
    assert len(calls) == 24 and 0 < len(checked) <= 24 // 4 + 2
    assert engine.runner.recompilations == 0


def test_a_trace_that_does_not_fit_the_engine_is_refused_by_its_guards(
    first, model, monkeypatch, caplog
):
    """Were a trace file's name to miss what the trace specializes on, the loaded guards are
    what stops it: Dynamo traces instead, and warm-up says so (a kiln bug to report). A bf16
    engine given the fp32 trace: a dtype is guarded whatever the process compiled before (a
    size may not be: Dynamo's automatic dynamic shapes make a dimension that differed
    between earlier compilations of the forward symbolic, and unguarded)."""
    fp32_trace = first.runner.forward.trace_file
    monkeypatch.setattr(
        "kiln.compiler.precompile.TraceFile.in_entry",
        classmethod(lambda cls, entry, device, static: fp32_trace),
    )
    kwargs = dict(block_size=4, max_num_batched_tokens=16, dtype="bfloat16")
    with caplog.at_level(logging.WARNING):
        engine = make_engine(model, compilation=COMPILED, **kwargs)
    assert engine.runner.forward.trace_file == fp32_trace
    (warning,) = [r.getMessage() for r in caplog.records if "during warm-up" in r.getMessage()]
    assert "dtype mismatch. expected Float, actual BFloat16" in warning
    _assert_matches_eager(make_engine(model, **kwargs), engine, rtol=0, atol=4 * 2**-8)


def test_an_unreadable_trace_is_told_and_traced_again(first, model, caplog):
    """A trace saved beside a sealed entry's own is outside its manifest, so the entry's
    checksums do not cover it: reading it is what finds it broken."""
    other = _engine(model, block_size=8)  # loads the block-size-8 trace saved above
    trace = other.runner.forward.trace_file.path
    assert other.runner.compile_backend.stats.trace == "loaded" and trace in _traces(first)
    trace.write_bytes(b"not a trace")
    with caplog.at_level(logging.WARNING):
        rebooted = _engine(model, block_size=8)
    (warning,) = [r.getMessage() for r in caplog.records if "could not be loaded" in r.getMessage()]
    assert str(trace) in warning and "tracing the forward again" in warning
    assert rebooted.runner.compile_backend.stats.trace == "traced and saved"
    assert _engine(model, block_size=8).runner.compile_backend.stats.trace == "loaded"


def test_aot_compile_false_traces_every_boot_and_saves_nothing(first, model):
    config = CompilationConfig(mode=3, aot_compile=False)
    before = _traces(first)
    engine = _engine(model, config=config)
    stats = engine.runner.compile_backend.stats
    assert stats.trace == 'traced (not saved: "aot_compile": false)'
    assert _traces(engine) == before
    assert 'Dynamo\'s trace (not saved: "aot_compile": false) and the first run' in (
        stats.summary("inductor")
    )
    _assert_matches_eager(make_engine(model, block_size=4, max_num_batched_tokens=16), engine)


def test_a_trace_torch_cannot_save_is_told_and_refused_when_strict(first, model, monkeypatch):
    """Block size 2: a shape set with no trace yet, so the boot tries to save one."""

    def refuse(self, args):
        raise RuntimeError("CLOSURE_MATCH guard cannot be serialized.")

    monkeypatch.setattr("kiln.compiler.precompile.PrecompiledForward._aot_compile", refuse)
    engine = _engine(model, block_size=2)
    stats = engine.runner.compile_backend.stats
    assert stats.trace_error == "RuntimeError: CLOSURE_MATCH guard cannot be serialized."
    assert stats.trace == f"traced (not saved: {stats.trace_error})"
    _assert_matches_eager(make_engine(model, block_size=2, max_num_batched_tokens=16), engine)
    with pytest.raises(ConfigError, match=r'--strict-graphs: "aot_compile" is on.*CLOSURE_MATCH'):
        make_engine(
            model, block_size=2, max_num_batched_tokens=16, compilation=COMPILED, strict_graphs=True
        )


def test_aot_compile_is_a_switch():
    assert CompilationConfig.from_json('{"mode": 3, "aot_compile": false}').aot_compile is False
    assert CompilationConfig().aot_compile is True
    with pytest.raises(ConfigError, match="aot_compile must be true or false, got 'no'"):
        CompilationConfig.from_json('{"aot_compile": "no"}')


@pytest.mark.parametrize(
    ("trace", "told"),
    [
        ("loaded", "Dynamo's trace loaded and the first run 0.5 s"),
        ("traced and saved", "Dynamo's trace (saved) and the first run 0.5 s"),
        ("traced (not saved: x)", "Dynamo's trace (not saved: x) and the first run 0.5 s"),
        ("", "Dynamo's trace and the first run 0.5 s"),
    ],
)
def test_the_compile_line_says_how_the_trace_came(trace, told):
    stats = CompileStats(compilations=1, pieces=1, compile_s=1.5, backend_s=1.0, trace=trace)
    assert stats.summary("inductor") == (
        f"1 graph, 1 piece (inductor) in 1.5 s: {told}, kiln's backend 1.0 s"
    )
