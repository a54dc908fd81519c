"""`kiln export-hf`: the embedded GGUF as a bf16 HF directory (what vLLM reads). The weights are
checked against kiln's own dequantizer, not transformers' (which wrote them), the config against
kiln's reading of the GGUF metadata, and kiln serves the result; mistakes are one-line errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kiln.cli.main import main
from kiln.default_model import cached_hf_export, exported_hf_dir
from kiln.errors import ConfigError


@pytest.fixture(scope="module")
def exported(smollm_path, tmp_path_factory) -> str:
    """One export through the command line, shared by the module (about 15 s)."""
    out = str(tmp_path_factory.mktemp("export") / "smollm2-bf16")
    assert main(["export-hf", out]) == 0
    return out


def test_export_writes_what_hf_loaders_read(exported):
    names = set(os.listdir(exported))
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    with open(os.path.join(exported, "config.json")) as f:
        config = json.load(f)
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config


def test_weights_are_kilns_dequantization_rounded_to_bf16(exported, smollm_path):
    """Bit-exact: transformers dequantized the Q4_1 blocks, kiln's loader does so again on its
    own, and every tensor rounds to the same bf16 values."""
    from safetensors.torch import load_file

    from kiln.loader.gguf import GGUFSource

    saved = load_file(os.path.join(exported, "model.safetensors"))
    reference = dict(GGUFSource(smollm_path).tensors(torch.float32))
    assert set(saved) == set(reference)
    for name, tensor in saved.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name


def test_config_is_the_gguf_metadata(exported, smollm_path):
    from kiln.loader.gguf import GGUFSource
    from kiln.loader.hf import HFDirectorySource

    assert HFDirectorySource(exported).config == GGUFSource(smollm_path).config


def test_kiln_serves_the_export(exported):
    from kiln import LLM
    from kiln.sampling_params import SamplingParams

    llm = LLM(exported, dtype="bfloat16", kv_cache_memory="256MiB", max_num_seqs=4)
    try:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16))
    finally:
        llm.close()
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["export-hf", "missing.gguf", "{tmp}/out"], "does not exist: pass the path of a .gguf"),
        (["export-hf", "{tmp}", "{tmp}/out"], "is a directory: export-hf converts a .gguf file"),
        (["export-hf", "{tmp}/notes.txt", "{tmp}/out"], "is not a .gguf file"),
        (["export-hf", "{model}", "{tmp}"], "is not an empty directory: remove it or choose"),
    ],
)
def test_mistakes_are_one_line_errors(tmp_path, smollm_path, capsys, argv, message):
    (tmp_path / "notes.txt").write_text("not a model")
    argv = [a.format(tmp=tmp_path, model=smollm_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_bad_dtype_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["export-hf", "out", "--dtype", "int4"])
    assert exc.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err


def test_the_cache_export_is_reused(smollm_path, tmp_path, monkeypatch):
    """A second request finds the directory and converts nothing; a changed GGUF (its size or
    time) gets a directory of its own."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    target = exported_hf_dir(smollm_path, "bf16")
    assert target.startswith(str(tmp_path)) and target == exported_hf_dir(smollm_path, "bfloat16")
    os.makedirs(target)
    with open(os.path.join(target, "config.json"), "w") as f:
        f.write("{}")

    def no_export(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr("kiln.default_model.export_hf", no_export)
    assert cached_hf_export(smollm_path, "bf16") == target
    assert exported_hf_dir(smollm_path, "fp16") != target
    with pytest.raises(ConfigError, match="unknown dtype"):
        exported_hf_dir(smollm_path, "int4")
