"""Every user mistake raises kiln's own error naming the field and the limit."""

from __future__ import annotations

import pytest

from kiln import InvalidRequestError, ModelLoadError, SamplingParams
from kiln.errors import ConfigError


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_sampling_params_errors(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field
    assert field in str(info.value)


def test_request_errors(smollm_llm):
    engine = smollm_llm.engine
    limit = engine.max_model_len
    cases = [
        ("", SamplingParams(), "prompt", "empty"),
        ([], SamplingParams(), "prompt", "empty"),
        ([5] * limit, SamplingParams(), "prompt", f"{limit}"),
        ([5] * 10, SamplingParams(max_tokens=limit), "max_tokens", rf"max_model_len \({limit}\)"),
        ([5, 10**9], SamplingParams(), "prompt", "49152"),
        ([5], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids", "vocabulary"),
    ]
    for prompt, params, field, words in cases:
        with pytest.raises(InvalidRequestError, match=words) as info:
            engine.add_request("bad", prompt, params)
        assert info.value.param == field
    assert not engine.has_unfinished_requests()  # nothing half-added
    out = smollm_llm.generate("Hi", SamplingParams(temperature=0, max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2  # the engine still serves


def test_model_errors(tmp_path):
    from kiln.loader import open_model

    with pytest.raises(ModelLoadError, match="not found"):
        open_model(str(tmp_path / "nothing"))
    (tmp_path / "config.json").write_text('{"architectures": ["MambaForCausalLM"]}')
    with pytest.raises(ModelLoadError, match=r"LlamaForCausalLM, Qwen2ForCausalLM"):
        open_model(str(tmp_path))
    (tmp_path / "w.bin").write_text("x")
    with pytest.raises(ModelLoadError, match=r"\.gguf"):
        open_model(str(tmp_path / "w.bin"))


def test_shape_mismatch_names_the_tensor(tiny_models, tmp_path):
    import json
    import shutil

    from kiln.llm import LLM

    path = tmp_path / "bad"
    shutil.copytree(tiny_models["llama"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight.*expected"):
        LLM(str(path), kv_cache_memory="8MiB")


def test_config_errors():
    from kiln.config.engine import CacheConfig, SchedulerConfig, parse_bytes

    with pytest.raises(ConfigError, match="block_size"):
        CacheConfig(block_size=3)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ConfigError, match="memory size"):
        parse_bytes("lots")
    assert parse_bytes("2GiB") == 2 * 2**30


@pytest.mark.parametrize(
    "name", ["quantization", "prefill_weights", "cpu_linears", "packed_activations",
             "eager_step_padding", "attention_backend"],
)  # fmt: skip
def test_option_outside_its_choices_is_refused(name):
    """The Python API and profiles are held to the choices argparse holds the flags to: a
    misspelt value (quantization="packed") once fell through to dequantizing every weight."""
    from dataclasses import fields

    from kiln.config.engine import EngineConfig

    (meta,) = [f.metadata["option"] for f in fields(EngineConfig) if f.name == name]
    with pytest.raises(ConfigError, match=f"{name} must be one of {', '.join(meta['choices'])}"):
        EngineConfig(**{name: "packd"})
    EngineConfig(**{name: meta["choices"][-1]})  # every listed choice is still taken
