"""Launcher profiles: the shipped ones load and differ only where they should, mistakes are
clear errors, `kiln serve --profile` lets flags override, and every probe's expected answer is
what HF transformers (fp32, the independent reference) answers for that model."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kiln.bench.probes import answer_passes, probe_messages
from kiln.cli.parsers import build_parser
from kiln.cli.serve import resolve_serve_args
from kiln.errors import ConfigError
from kiln.profiles import Probe, load_profile, shipped_profiles


def test_shipped_profiles_are_the_reports_two_launchers():
    assert {"smollm2-baseline", "smollm2-compiled"} <= set(shipped_profiles())
    base, fixed = load_profile("smollm2-baseline"), load_profile("smollm2-compiled")
    assert base.serve["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert fixed.serve["compilation_config"] == {
        "mode": 3,
        "cudagraph_mode": "FULL_AND_PIECEWISE",
    }
    # the same launcher except one setting
    rest = {k: v for k, v in base.serve.items() if k != "compilation_config"}
    assert rest == {k: v for k, v in fixed.serve.items() if k != "compilation_config"}
    assert base.model is None and base.probes == fixed.probes and len(base.probes) >= 2


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "p.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("name = 'x'\n[serve]\nmax_num_seq = 4\n", "unknown option 'max_num_seq'"),
        ("name = 'x'\n[serve]\nmax_num_seqs = '4'\n", "max_num_seqs must be int"),
        ("name = 'x'\n[serve]\nenforce_eager = 1\n", "enforce_eager must be bool"),
        ("name = 'x'\nengin = 'kiln'\n", "unknown keys"),
        ("name = 'x'\nengine = 'external'\n", "needs a `command`"),
        ("name = 'x'\n[[probes]]\nprompt = 'hi'\n", "`prompt` and `expect`"),
        ("name = \n", "not valid TOML"),
        ("name = 'x'\nrandom_weights = 1\n", "random_weights must be true or false"),
    ],
)
def test_profile_mistakes_are_clear_errors(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_profile(_write(tmp_path, text))


def test_unknown_profile_names_the_shipped_ones():
    with pytest.raises(ConfigError, match="smollm2-baseline"):
        load_profile("no-such-profile")


def test_serve_flags_override_the_profile():
    args = build_parser().parse_args(
        ["serve", "--profile", "smollm2-compiled", "--max-num-seqs", "4", "--port", "9"]
    )
    args = resolve_serve_args(args)
    assert args.max_num_seqs == 4 and args.port == 9  # flags win
    assert args.max_num_batched_tokens == 512 and args.kv_cache_memory == "2GiB"  # profile
    assert json.loads(args.compilation_config) == {
        "mode": 3,
        "cudagraph_mode": "FULL_AND_PIECEWISE",
    }
    assert args.host == "127.0.0.1" and args.shutdown_timeout == 30.0  # defaults
    plain = resolve_serve_args(build_parser().parse_args(["serve"]))
    assert plain.port == 8000 and plain.max_num_seqs is None


def test_the_long_context_profiles_pair_kiln_and_llama_cpp_without_probes():
    """Random weights answer nothing: no probes on either side, and both hold a 40,960-token
    context (the model's), resolved through `kiln serve`'s own parser."""
    kiln_side, llama = load_profile("long-context"), load_profile("llama-cpp-long")
    assert kiln_side.probes == () and llama.probes == () and llama.engine == "external"
    assert kiln_side.random_weights and llama.random_weights  # text checks off, lengths on
    assert not load_profile("smollm2-compiled").random_weights
    args = resolve_serve_args(build_parser().parse_args(["serve", "--profile", "long-context"]))
    assert args.max_model_len == 40960 and args.dtype == "bfloat16"
    assert llama.command[llama.command.index("--n_ctx") + 1] == "40960"


def test_answer_matching():
    assert answer_passes("The capital of France is Paris.", "paris")
    assert not answer_passes("It is Lyon.", "Paris")


def _hf_answer(model, tokenizer, probe: Probe) -> str:
    text = tokenizer.apply_chat_template(
        probe_messages(probe), tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=probe.max_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm_path):
    from transformers import AutoTokenizer

    folder, name = os.path.split(smollm_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.mark.parametrize("profile", ["smollm2-baseline", "smollm2-compiled"])
def test_shipped_probes_hold_under_hf_transformers(hf_smollm, hf_tokenizer, profile):
    for probe in load_profile(profile).probes:
        answer = _hf_answer(hf_smollm, hf_tokenizer, probe)
        assert answer_passes(answer, probe.expect), (probe.prompt, answer)


@pytest.mark.parametrize(
    ("prompt", "expect"),
    [("What is 5 + 5?", "10"), ("What is the capital of Italy?", "Rome")],
)
def test_questions_the_model_gets_wrong_are_not_probes(hf_smollm, hf_tokenizer, prompt, expect):
    """DESIGN.md's record: SmolLM2-135M misses these under the reference, so a probe built on
    them would fail every engine, right or wrong."""
    answer = _hf_answer(hf_smollm, hf_tokenizer, Probe(prompt, expect))
    assert not answer_passes(answer, expect), answer
    shipped = {p.prompt for p in load_profile("smollm2-baseline").probes}
    assert prompt not in shipped
