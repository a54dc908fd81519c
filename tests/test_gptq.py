"""HF W4A16 directories (GPTQ, AutoRound's GPTQ packing): a packer written from the format's
description (checked on hand-computed words), tiny checkpoints in it, and kiln's packed logits
against HF transformers running the same weights, dequantized by the format's formula
w = scale * (q - zero) from the integers the packer was given; unsupported variants refused
with what is supported."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from kiln import SamplingParams
from kiln.errors import ModelLoadError
from kiln.layers.packed import PackedInt4
from kiln.loader.gptq import gptq_format
from tests.helpers import make_engine, run_schedule

BF16_ULP = 2**-8
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_words(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """GPTQ's packing: 32/bits codes per int32 along `dim`, the first in the lowest bits."""
    per_word = 32 // bits
    v = values.to(torch.int64).movedim(dim, 0)
    v = v.reshape(v.shape[0] // per_word, per_word, *v.shape[1:])
    shifts = (torch.arange(per_word) * bits).view(per_word, *[1] * (v.dim() - 2))
    words = (v << shifts).sum(1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # the int32 bit pattern
    return words.to(torch.int32).movedim(0, dim).contiguous()


def test_packer_matches_hand_computed_words():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [15, 0, 0, 0, 0, 0, 0, 0]])  # [N=2, K=8]
    qweight = pack_words(codes.t(), 4, 0)  # along K: one word per column
    assert qweight.tolist() == [[0x87654321 - 2**32, 15]]
    zeros = torch.tensor([[3, 1, 0, 0, 0, 0, 0, 9]])  # [groups=1, N=8]
    assert pack_words(zeros, 4, 1).tolist() == [[0x90000013 - 2**32]]
    assert pack_words(torch.tensor([[200, 1, 2, 3]]), 8, 1).tolist() == [[0x030201C8]]


def _quantize_layer(shape, bits: int, group: int, sym: bool, gen: torch.Generator):
    """Random integer codes, zero points and fp16 scales of one [N, K] linear; the reference
    weight w = scale (q - zero) computed from them."""
    n, k = shape
    g = k if group == -1 else group
    top = 2**bits
    q = torch.randint(0, top, (n, k), generator=gen)
    zeros = (
        torch.full((n, k // g), top // 2)
        if sym
        else torch.randint(1, top - 1, (n, k // g), generator=gen)
    )
    scales = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.005).half()
    w = scales.float().repeat_interleave(g, 1) * (q - zeros.repeat_interleave(g, 1))
    return q, zeros, scales, w


def _write_checkpoint(src: str, dst, config: dict, zero_offset: int, seed: int = 0):
    """The tiny Llama with every decoder linear quantized (embedding, head and norms stay
    dense, as GPTQ leaves them); returns the reference weights {name: w}."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    bits, group = config["bits"], config["group_size"]
    gen, reference = torch.Generator().manual_seed(seed), {}
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        q, zeros, scales, w = _quantize_layer(tensors[name].shape, bits, group, config["sym"], gen)
        prefix = name.removesuffix(".weight")
        del tensors[name]
        tensors[f"{prefix}.qweight"] = pack_words(q.t(), bits, 0)
        tensors[f"{prefix}.qzeros"] = pack_words(zeros.t() - zero_offset, bits, 1)
        tensors[f"{prefix}.scales"] = scales.t().contiguous()
        g = q.shape[1] if group == -1 else group
        tensors[f"{prefix}.g_idx"] = (torch.arange(q.shape[1]) // g).to(torch.int32)
        reference[name] = w
    save_file(tensors, str(dst / "model.safetensors"))
    hf_config = json.loads((dst / "config.json").read_text())
    hf_config["quantization_config"] = config
    (dst / "config.json").write_text(json.dumps(hf_config))
    return reference


PROMPT = [5, 17, 300, 4000, 12, 9, 77, 1024]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _greedy_against_hf(engine, hf):
    """kiln's logits of 4 greedy steps, its tokens, and HF's logits on the same sequence."""
    out, logits = run_schedule(engine, [(0, PROMPT, GREEDY)], record_logits=True)
    ours, tokens = torch.stack(logits["0"]).float(), out["0"].outputs[0].token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT + tokens[:-1]])).logits[0, len(PROMPT) - 1 :]
    return ours, tokens, ref


FORMATS = {
    "gptq-4bit-g32-asym": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False,
                            "desc_act": False}, 1),
    "gptq_v2-8bit-per-row-sym": ({"quant_method": "gptq", "bits": 8, "group_size": -1,
                                  "sym": True, "desc_act": False,
                                  "checkpoint_format": "gptq_v2"}, 0),
    "autoround-4bit-g64-sym": ({"quant_method": "auto-round", "bits": 4, "group_size": 64,
                                "sym": True, "packing_format": "auto_round:auto_gptq"}, 1),
}  # fmt: skip


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_w4a16_checkpoint_matches_hf_on_the_dequantized_weights(tiny_models, tmp_path, fmt):
    config, zero_offset = FORMATS[fmt]
    path = tmp_path / "w4a16"
    reference = _write_checkpoint(tiny_models["llama"], path, config, zero_offset)
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"]).eval()
    with torch.no_grad():
        for name, w in reference.items():
            hf.get_parameter(name).copy_(w)
    engine = make_engine(str(path))
    model = engine.runner.model
    assert sum(isinstance(m, PackedInt4) for m in model.modules()) == 2 * 4  # 2 layers x 4
    ours, tokens, ref = _greedy_against_hf(engine, hf)
    # bf16 outputs of each plane's product (test_packed.py): a few bf16 ulps per plane
    # (measured: 2.9 and 2.2 for 4 bits, 9.6 for 8 bits, whose low plane's zero term is large)
    planes = 2 if config["bits"] == 8 else 1
    tol = 8 * planes * BF16_ULP * ref.abs().max().item()
    torch.testing.assert_close(ours, ref, rtol=0, atol=tol)
    assert tokens == ref.argmax(-1).tolist()
    dense = make_engine(str(path), quantization="none")  # dequantized at load, float32
    _, logits = run_schedule(dense, [(0, PROMPT, GREEDY)], record_logits=True)
    torch.testing.assert_close(torch.stack(logits["0"]).float(), ref, rtol=1e-4,
                               atol=1e-4 * ref.abs().max().item())  # fmt: skip


@pytest.mark.parametrize(
    "change,named",
    [
        ({"desc_act": True}, "desc_act true"),
        ({"bits": 3}, "bits 3"),
        ({"quant_method": "awq"}, "'awq' is not supported"),
        ({"quant_method": "auto-round", "packing_format": "auto_round:auto_awq"}, "packing_format"),
    ],
)
def test_unsupported_variants_are_refused_with_what_is_supported(change, named):
    config = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, **change}
    with pytest.raises(ModelLoadError) as err:
        gptq_format(config)
    assert named in str(err.value) and "bits 4 or 8" in str(err.value)


def test_act_order_indices_are_refused(tiny_models, tmp_path):
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
    path = tmp_path / "act-order"
    _write_checkpoint(tiny_models["llama"], path, config, 1)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="act-order g_idx"):
        make_engine(str(path))


def _set_hf_weight(hf, name: str, w: torch.Tensor) -> None:
    """A checkpoint weight into HF's model: one expert's projection (`...experts.3.up_proj.
    weight`) into the stacked tensor transformers keeps in memory, others by name."""
    if ".experts." not in name:
        hf.get_parameter(name).copy_(w)
        return
    owner, rest = name.split(".experts.")
    expert, proj, _ = rest.split(".")
    if proj == "down_proj":
        hf.get_parameter(f"{owner}.experts.down_proj")[int(expert)].copy_(w)
        return
    stacked = hf.get_parameter(f"{owner}.experts.gate_up_proj")[int(expert)]
    half = stacked.shape[0] // 2
    stacked[:half].copy_(w) if proj == "gate_proj" else stacked[half:].copy_(w)


def test_a_w4a16_moe_checkpoint_keeps_its_experts_packed(tiny_models, tmp_path):
    """GPTQ's MoE checkpoints quantize every expert's projections (the router stays dense):
    kiln packs each projection's experts into one stack and matches HF on the dequantized
    weights within the 4-bit bound above."""
    from kiln.layers.packed_experts import PackedExperts

    config, zero_offset = FORMATS["gptq-4bit-g32-asym"]
    path = tmp_path / "w4a16-moe"
    reference = _write_checkpoint(tiny_models["qwen3_moe"], path, config, zero_offset)
    assert any(".experts.3.down_proj" in name for name in reference)
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3_moe"]).eval()
    with torch.no_grad():
        for name, w in reference.items():
            _set_hf_weight(hf, name, w)
    engine = make_engine(str(path))
    model = engine.runner.model
    assert sum(isinstance(m, PackedExperts) for m in model.modules()) == 2  # layer 0's stacks
    assert "experts: gptq -> int4 packed, group 32" in [f for f, _, _ in model.weight_summary]
    ours, tokens, ref = _greedy_against_hf(engine, hf)
    torch.testing.assert_close(ours, ref, rtol=0, atol=8 * BF16_ULP * ref.abs().max().item())
    assert tokens == ref.argmax(-1).tolist()
