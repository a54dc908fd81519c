"""The compile cache: keyed by everything that changes artifacts, corrupted entries rebuilt,
`kiln cache ls|clear` showing and clearing it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from kiln.attention.backend import GraphSupport
from kiln.compilation.cache import (
    CompileCacheEntry,
    cache_key,
    cache_key_fields,
    list_entries,
    open_for_plan,
)
from kiln.compilation.config import CompilationConfig
from kiln.compilation.plan import AttentionCaps, DeviceCaps, resolve_graph_plan

BASE = dict(
    model_config={"architecture": "LlamaForCausalLM", "hidden_size": 64},
    compilation={
        "mode": 3,
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "decode_capture_sizes": [1, 2, 4],
        "mixed_capture_sizes": [1, 2, 4],
        "splitting_ops": ["kiln::torch_paged_attention"],
    },
    dtype="float32",
    device="cuda:NVIDIA H200:sm90",
    source_hash="abc",
)


def _key(**changes) -> str:
    fields = {**BASE, **changes}
    return cache_key(cache_key_fields(**fields))


@pytest.mark.parametrize(
    "changes",
    [
        {"compilation": {**BASE["compilation"], "decode_capture_sizes": [1, 2, 4, 8]}},
        {"compilation": {**BASE["compilation"], "mixed_capture_sizes": [1, 2]}},
        {"compilation": {**BASE["compilation"], "cudagraph_mode": "PIECEWISE"}},
        {"compilation": {**BASE["compilation"], "mode": 0}},
        {"compilation": {**BASE["compilation"], "splitting_ops": []}},
        {"dtype": "bfloat16"},
        {"device": "cuda:NVIDIA H100:sm90"},
        {"model_config": {"architecture": "LlamaForCausalLM", "hidden_size": 128}},
        {"source_hash": "abd"},
    ],
)
def test_any_change_gives_another_directory(changes):
    assert _key(**changes) != _key()


def test_same_config_same_directory():
    assert _key() == _key()
    assert cache_key_fields(**BASE)["torch"]  # the torch version is part of the key


def _plan(**requested) -> dict:
    attention = AttentionCaps("triton", GraphSupport.ALWAYS, ("kiln::triton_paged_attention",))
    plan = resolve_graph_plan(
        CompilationConfig(**requested),
        DeviceCaps("cuda", True),
        attention,
        max_num_batched_tokens=256,
        max_num_seqs=64,
    )
    return plan.to_dict()


@pytest.mark.parametrize(
    "changes",
    [
        {"cudagraph_capture_sizes": (1, 2, 4, 8)},
        {"cudagraph_capture_sizes": None, "max_cudagraph_capture_size": 16},
        {"cudagraph_mode": "PIECEWISE"},
        {"cudagraph_mode": "FULL"},
        {"splitting_ops": ()},
    ],
)
def test_the_engine_keys_its_entry_by_the_resolved_plan(tmp_path, changes):
    """What the engine passes in (a resolved plan), not only the key function, tells entries
    apart."""
    base = {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": (1, 2, 4)}
    args = (BASE["model_config"], "float32", torch.device("cpu"), tmp_path)
    path = open_for_plan(_plan(**base), *args).path
    assert open_for_plan(_plan(**base), *args).path == path
    assert open_for_plan(_plan(**{**base, **changes}), *args).path != path


def test_a_request_that_resolves_to_the_same_plan_shares_the_entry(tmp_path):
    args = (BASE["model_config"], "float32", torch.device("cpu"), tmp_path)
    sizes = {"mode": 3, "cudagraph_capture_sizes": (1, 2, 4)}
    capped = {**sizes, "max_cudagraph_capture_size": 16}  # caps nothing: same artifacts
    assert open_for_plan(_plan(**sizes), *args).path == open_for_plan(_plan(**capped), *args).path


def test_corrupted_entry_is_rebuilt(tmp_path, caplog):
    fields = cache_key_fields(**BASE)
    entry = CompileCacheEntry.open(fields, tmp_path)
    assert not entry.reused
    artifact = entry.path / "inductor" / "piece.py"
    artifact.parent.mkdir()
    artifact.write_text("compiled code")
    entry.seal()
    assert CompileCacheEntry.open(fields, tmp_path).reused
    artifact.write_text("compiled code, truncated by a crash")
    with caplog.at_level(logging.WARNING):
        again = CompileCacheEntry.open(fields, tmp_path)
    assert not again.reused and not artifact.exists()
    assert "corrupted" in caplog.text and "checksum" in caplog.text
    # an entry whose compilation never finished (no manifest) is rebuilt too
    with caplog.at_level(logging.WARNING):
        assert not CompileCacheEntry.open(fields, tmp_path).reused
    assert "no manifest" in caplog.text


def test_activate_points_inductor_inside_the_entry(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    entry = CompileCacheEntry.open(cache_key_fields(**BASE), tmp_path)
    entry.activate()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(entry.path))
    assert os.environ["TRITON_CACHE_DIR"].startswith(str(entry.path))


def test_cli_ls_and_clear(tmp_path):
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path)}
    entry = CompileCacheEntry.open(cache_key_fields(**BASE), tmp_path / "compile")
    entry.seal()

    def kiln(*args):
        return subprocess.run(
            [sys.executable, "-m", "kiln", "cache", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    out = kiln("ls")
    assert out.returncode == 0 and entry.path.name in out.stdout and "ok" in out.stdout
    assert "FULL_AND_PIECEWISE" in out.stdout
    assert len(list_entries(tmp_path / "compile")) == 1
    out = kiln("clear")
    assert out.returncode == 0 and "removed 1" in out.stdout
    assert "empty" in kiln("ls").stdout
