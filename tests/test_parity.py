"""Numerical parity with HF transformers (fp32, eager attention) on tiny random-weight models
of every supported architecture: the logits behind every sampled token, in batches that mix
chunked prefills and decodes of different lengths, with prefix caching on and off, at two
block sizes."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from kiln import SamplingParams
from tests.conftest import TINY_VARIANTS, VISION_LANGUAGE_VARIANTS, make_tiny_vision_language_model
from tests.helpers import make_engine, run_schedule

GEN = 6


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 49000, (40,), generator=g).tolist()
    fresh = [torch.randint(3, 49000, (n,), generator=g).tolist() for n in (5, 23, 61)]
    # the last two share a 40-token prefix with each other (prefix-cache hits when on)
    return [fresh[0], fresh[1], shared + fresh[2][:9], fresh[2], shared + fresh[1][:3]]


ARRIVALS = [0, 0, 0, 3, 9]  # later arrivals join batches that are already decoding


def _hf_logits(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        out = model(ids).logits[0]
    return out[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def _run(engine, prompts: list[list[int]]):
    """The arrival schedule, greedy; final outputs and the logits behind every token."""
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    arrivals = [(t, p, params) for t, p in zip(ARRIVALS, prompts)]
    return run_schedule(engine, arrivals, record_logits=True)


def _check(hf_model, prompts, finals, logits):
    for rid, out in finals.items():
        prompt = prompts[int(rid)]
        generated = out.outputs[0].token_ids
        assert len(generated) == GEN
        ref = _hf_logits(hf_model, prompt, generated)
        ours = torch.stack(logits[rid]).cpu()
        scale = ref.abs().max().item()
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * scale)
        assert generated == ref.argmax(-1).tolist()


@pytest.mark.parametrize("name", list(TINY_VARIANTS))
@pytest.mark.parametrize("block_size,prefix_caching", [(16, True), (4, True), (16, False)])
def test_logits_match_hf(tiny_models, hf_models, name, block_size, prefix_caching):
    engine = make_engine(
        tiny_models[name],
        block_size=block_size,
        prefix_caching=prefix_caching,
        max_num_batched_tokens=24,
    )
    prompts = _prompts()
    finals, logits = _run(engine, prompts)
    _check(hf_models[name], prompts, finals, logits)
    cached = finals["4"].num_cached_tokens
    hybrid = engine.model_config.is_hybrid
    if prefix_caching and hybrid:  # cut back to the last block end with a saved state
        assert 0 < cached <= 40 and cached % block_size == 0
    elif prefix_caching:
        assert cached >= 40 - block_size  # the shared prefix came from the cache
    else:
        assert cached == 0
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    slots = engine.blocks.state_slots
    assert slots is None if not hybrid else slots.num_free == slots.num_slots  # none leaked


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_bf16_logits_are_as_close_to_fp32_as_hf_bf16s(tiny_models, hf_models, name):
    """bf16 on the CPU (oneDNN's bf16 weights where the CPU has AVX512-BF16): kiln's logits
    stray from HF's fp32 logits no further than HF's own bf16 model does."""
    engine = make_engine(tiny_models[name], max_num_batched_tokens=24, dtype="bfloat16")
    prompts = _prompts()
    finals, logits = _run(engine, prompts)
    hf_bf16 = copy.deepcopy(hf_models[name]).to(torch.bfloat16)
    for rid, out in finals.items():
        prompt, generated = prompts[int(rid)], out.outputs[0].token_ids
        ref = _hf_logits(hf_models[name], prompt, generated)
        theirs = (_hf_logits(hf_bf16, prompt, generated).float() - ref).abs().max().item()
        ours = (torch.stack(logits[rid]).float() - ref).abs().max().item()
        assert ours <= 2 * theirs, (rid, ours, theirs)


def test_mixed_batches_really_mixed(tiny_models):
    """The schedule above does put prefill chunks and decodes into the same step."""
    engine = make_engine(tiny_models["llama"], max_num_batched_tokens=24)
    seen = []
    original = engine.runner.prepare

    def spy(batch):
        seen.append(sorted(batch.num_tokens))
        return original(batch)

    engine.runner.prepare = spy
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    run_schedule(engine, [(t, p, params) for t, p in zip(ARRIVALS, _prompts())])
    assert any(n[0] == 1 and n[-1] > 1 for n in seen), seen
    assert any(n[-1] == 24 or sum(n) == 24 for n in seen)  # the token budget chunked a prompt


@pytest.mark.parametrize("name", list(VISION_LANGUAGE_VARIANTS))
def test_an_image_text_checkpoint_serves_its_text_model(tokenizer_dir, tmp_path, caplog, name):
    """Qwen3.5's released checkpoints are image-text models (`model.language_model.*`,
    `model.visual.*`, the text config nested): kiln serves the text model with the logits of
    HF's image-text model on text, and says it left the vision tower unread."""
    import transformers

    path = make_tiny_vision_language_model(str(tmp_path), name, tokenizer_dir)
    with caplog.at_level("WARNING", logger="kiln.loader.hf"):
        engine = make_engine(path, max_num_batched_tokens=24)
    vision = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(vision) == 1 and "tensors are not loaded" in vision[0]
    text_model = {"qwen3_5_vl": "Qwen3_5ForCausalLM", "qwen3_5_moe_vl": "Qwen3_5MoeForCausalLM"}
    assert engine.model_config.architecture == text_model[name]
    hf = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    prompts = _prompts()
    finals, logits = _run(engine, prompts)
    _check(hf, prompts, finals, logits)


def test_a_qwen3moe_gguf_matches_hf(tiny_models, hf_models, tmp_path):
    """llama.cpp's `qwen3moe` file layout (experts stacked per projection, the router as
    `ffn_gate_inp`, a dense layer without one, the top-k renormalisation flag) gives the HF
    model's logits."""
    import gguf

    from kiln.loader.gguf import GGUFSource
    from tests.gguf_files import write_gguf

    path = tmp_path / "tiny-moe.gguf"
    write_gguf(path, hf_models["qwen3_moe"], lambda name: gguf.GGMLQuantizationType.F32,
               arch="qwen3moe")  # fmt: skip
    config = GGUFSource(str(path)).config
    assert config.architecture == "Qwen3MoeForCausalLM" and config.sparse_layers == (0,)
    assert (config.moe.num_experts, config.moe.top_k, config.moe.norm_topk_prob) == (4, 2, False)
    engine = make_engine(str(path), tokenizer=tiny_models["qwen3_moe"], max_num_batched_tokens=24)
    prompts = _prompts()
    finals, logits = _run(engine, prompts)
    _check(hf_models["qwen3_moe"], prompts, finals, logits)


def _hybrid_with_random_norms(path: str):
    """HF's tiny hybrid with every norm weight, A_log and dt_bias random and far apart (they
    start at zero or one, or close: a missing + 1 or a value head out of place must show)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 2)
    return hf.eval()


def test_a_qwen3next_gguf_matches_hf(tiny_models, tmp_path):
    """llama.cpp's `qwen3next` layout (in_proj_qkvz split into attn_qkv and attn_gate across
    key-head groups, norms stored + 1, A_log as -exp(A_log), the convolution squeezed, the
    shared expert as *_shexp, the layer pattern from full_attention_interval) gives the HF
    model's logits; the same file with attn_qkv/attn_gate in Q8_0 keeps them packed and equals
    its own dequantized load within the kernels' bf16 rounding."""
    import gguf

    from kiln.loader.gguf import GGUFSource
    from tests.gguf_files import write_gguf

    hf = _hybrid_with_random_norms(tiny_models["qwen3_next"])
    path = tmp_path / "tiny-next.gguf"
    write_gguf(path, hf, lambda name: gguf.GGMLQuantizationType.F32, arch="qwen3next")
    source = GGUFSource(str(path))
    assert source.config.layer_types == ("linear_attention", "full_attention")
    assert source.config.partial_rotary_factor == 0.25
    assert source.config.moe.shared_intermediate_size == 48
    engine = make_engine(str(path), tokenizer=tiny_models["qwen3_next"],
                         max_num_batched_tokens=24)  # fmt: skip
    prompts = _prompts()
    finals, logits = _run(engine, prompts)
    _check(hf, prompts, finals, logits)

    q8 = gguf.GGMLQuantizationType.Q8_0
    quantized = tmp_path / "tiny-next-q8.gguf"
    write_gguf(quantized, hf, lambda name: q8 if "attn_qkv" in name or "attn_gate" in name
               else gguf.GGMLQuantizationType.F32, arch="qwen3next")  # fmt: skip
    runs = {}
    for mode in ("auto", "none"):
        engine = make_engine(str(quantized), tokenizer=tiny_models["qwen3_next"],
                             quantization=mode)  # fmt: skip
        qkvz = engine.runner.model.layers[0].linear_attn.in_proj_qkvz
        assert (qkvz.layout == "int4") == (mode == "auto")
        runs[mode] = _run(engine, prompts[:2])[1]
    for rid, ref in runs["none"].items():
        ref = torch.stack(ref)
        torch.testing.assert_close(torch.stack(runs["auto"][rid]), ref, rtol=0,
                                   atol=8 * 2**-8 * ref.abs().max().item())  # fmt: skip


@pytest.mark.parametrize("name,arch", [("qwen3_5", "qwen35"), ("qwen3_5_moe", "qwen35moe")])
def test_a_qwen35_gguf_matches_hf(tiny_models, tmp_path, name, arch):
    """llama.cpp's Qwen3.5 layout (separate projections as attn_qkv, attn_gate, ssm_beta and
    ssm_alpha; with 4 value heads on 2 key heads every value-head axis tiled, out_proj's
    columns too; norms + 1; A_log as -exp(A_log)) gives the HF model's logits."""
    import gguf

    from kiln.loader.gguf import GGUFSource
    from tests.gguf_files import write_gguf

    hf = _hybrid_with_random_norms(tiny_models[name])
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, hf, lambda _: gguf.GGMLQuantizationType.F32, arch=arch)
    config = GGUFSource(str(path)).config
    assert config.linear_attention.grouped_projections is False
    assert config.layer_types == ("linear_attention", "full_attention")
    engine = make_engine(str(path), tokenizer=tiny_models[name], max_num_batched_tokens=24)
    prompts = _prompts()
    finals, logits = _run(engine, prompts)
    _check(hf, prompts, finals, logits)
    # the DeltaNet's projections in Q8_0: their reordered rows stay packed (ssm_out's columns,
    # value heads of 8 inside groups of 32, are dequantized); packed equals the dequantized load
    q8 = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out")
    quantized = tmp_path / f"tiny-{arch}-q8.gguf"
    write_gguf(quantized, hf, lambda n: gguf.GGMLQuantizationType.Q8_0 if any(p in n for p in q8)
               else gguf.GGMLQuantizationType.F32, arch=arch)  # fmt: skip
    runs = {}
    for mode in ("auto", "none"):
        engine = make_engine(str(quantized), tokenizer=tiny_models[name], quantization=mode)
        layer = engine.runner.model.layers[0].linear_attn
        assert (layer.in_proj_qkv.layout == "int4") == (mode == "auto")
        assert layer.out_proj.layout != "int4"
        runs[mode] = _run(engine, prompts[:2])[1]
    for rid, ref in runs["none"].items():
        ref = torch.stack(ref)
        torch.testing.assert_close(torch.stack(runs["auto"][rid]), ref, rtol=0,
                                   atol=8 * 2**-8 * ref.abs().max().item())  # fmt: skip


def test_a_qwen35_gguf_keeps_its_mtp_head(mtp_models, tmp_path):
    """Qwen3.5 files carry the MTP head as a block after the model's (`nextn_predict_layers`,
    `nextn.*`): it reads back as the checkpoint's `mtp.*` tensors, not as a decoder layer."""
    import gguf
    from safetensors.torch import load_file

    from kiln.loader.gguf import GGUFSource
    from tests.gguf_files import write_gguf

    stored = load_file(os.path.join(mtp_models["qwen3_5"], "model.safetensors"))
    mtp = {k: v for k, v in stored.items() if k.startswith("mtp.")}
    hf = _hybrid_with_random_norms(mtp_models["qwen3_5"])
    path = tmp_path / "tiny-qwen35-mtp.gguf"
    write_gguf(path, hf, lambda _: gguf.GGMLQuantizationType.F32, arch="qwen35", mtp=mtp)
    source = GGUFSource(str(path))
    assert source.config.num_layers == 2
    read = {k: v for k, v in source.tensors(torch.float32) if k.startswith("mtp.")}
    assert set(read) == set(mtp)
    for k, v in mtp.items():
        torch.testing.assert_close(read[k], v.float(), rtol=0, atol=1e-6)
