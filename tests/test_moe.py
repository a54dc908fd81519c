"""The mixture-of-experts MLP (kiln/layers/moe.py): its two expert products against a per-token
hand computation, the whole block against HF transformers' Qwen3-MoE and Qwen3-Next blocks
(softmax top-k, normalised or not, a shared expert behind a sigmoid gate), the experts loaded
from either on-disk form, and `kiln info` naming them. Whole-model parity with HF (prefill,
decode, chunks, prefix hits) is in test_parity.py, mode 3 in test_compiled.py, the graph modes
in test_graphs.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kiln.errors import ModelLoadError
from kiln.layers.moe import SparseMoE, experts_by_loop, experts_grouped

E, H, I, K = 6, 16, 8, 2  # noqa: E741 - the intermediate size


def _per_token(x, gate_up, down, ids, weights) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (down[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_both_expert_products_equal_a_per_token_computation(tokens):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    ids = torch.rand(tokens, E, generator=g).topk(K, dim=-1).indices
    ids[:, 0] = 0  # expert 0 busy, some experts idle: empty groups
    weights = torch.rand(tokens, K, generator=g)
    expected = _per_token(x, gate_up, down, ids, weights)
    for product in (experts_by_loop, experts_grouped):
        torch.testing.assert_close(product(x, gate_up, down, ids, weights), expected)


def _hf_block(kind: str, norm: bool):
    import transformers

    common = dict(hidden_size=H, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                  norm_topk_prob=norm, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        return Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(**common))
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    cfg = transformers.Qwen3NextConfig(shared_expert_intermediate_size=12, **common)
    return Qwen3NextSparseMoeBlock(cfg)


@pytest.mark.parametrize(("kind", "norm"), [("qwen3_moe", False), ("qwen3_moe", True),
                                            ("qwen3_next", True)])  # fmt: skip
def test_the_block_equals_hf(kind, norm):
    hf = _hf_block(kind, norm)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.5)  # a router far from ties
    shared = 12 if kind == "qwen3_next" else 0
    ours = SparseMoE(H, E, K, I, norm, shared)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
        if shared:
            s = hf.shared_expert
            ours.shared_expert.gate_up_proj.weight.copy_(
                torch.cat([s.gate_proj.weight, s.up_proj.weight])
            )
            ours.shared_expert.down_proj.weight.copy_(s.down_proj.weight)
            ours.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
    x = torch.randn(1, 9, H)
    with torch.no_grad():
        expected = hf(x)
        expected = expected[0] if isinstance(expected, tuple) else expected
        torch.testing.assert_close(ours(x[0]), expected[0])


def _stacked_copy(src: str, dst: str) -> None:
    """The tiny MoE checkpoint with its experts in HF's in-memory form: one stacked
    gate_up_proj and down_proj per layer instead of a tensor per expert and projection."""
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        experts = json.load(f)["num_local_experts"]
    stacked = {k: v for k, v in tensors.items() if ".experts." not in k}
    prefix = "model.layers.0.mlp.experts"
    part = lambda e, p: tensors[f"{prefix}.{e}.{p}.weight"]  # noqa: E731
    stacked[f"{prefix}.gate_up_proj"] = torch.stack(
        [torch.cat([part(e, "gate_proj"), part(e, "up_proj")]) for e in range(experts)]
    )
    stacked[f"{prefix}.down_proj"] = torch.stack([part(e, "down_proj") for e in range(experts)])
    save_file(stacked, os.path.join(dst, "model.safetensors"))


def _experts_of(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    from kiln.attention.torch_backend import TorchPagedAttentionBackend
    from kiln.loader import open_model
    from kiln.models import build_model
    from kiln.models.weights import load_weights

    source = open_model(path)
    model = build_model(source.config, TorchPagedAttentionBackend(torch.float32))
    load_weights(model, source.tensors(torch.float32))
    experts = model.layers[0].mlp.experts
    return experts.gate_up_proj.clone(), experts.down_proj.clone()


def test_experts_load_from_either_form_and_a_missing_one_is_named(tiny_models, tmp_path):
    per_expert = _experts_of(tiny_models["qwen3_moe"])
    _stacked_copy(tiny_models["qwen3_moe"], str(tmp_path / "stacked"))
    for a, b in zip(per_expert, _experts_of(str(tmp_path / "stacked"))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_models["qwen3_moe"], broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"lacks 1 tensors .*layers\.0\.mlp\.experts\.3\.up_proj\.weight"
    ):
        _experts_of(str(broken))


def test_kiln_info_names_the_experts_and_the_layer_types(tiny_models, capsys):
    from kiln.cli.main import main

    assert main(["info", tiny_models["qwen3_moe"], "--kv-cache-memory", "4MiB"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3MoeForCausalLM" in out
    assert "top 2 of 4, intermediate 32" in out and "sparse layers" in out and "1 of 2: 0" in out
    assert main(["info", tiny_models["qwen3_next"], "--kv-cache-memory", "8MiB",
                 "--no-enable-prefix-caching"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "shared expert 48" in out and "Gated DeltaNet 0; attention 1" in out
    state = ((2 * 2 * 16 + 4 * 8) * 3 + 4 * 16 * 8) * 4  # as test_hybrid computes it
    assert f"state per sequence        {state / 1024:.1f} KiB" in out


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5",
                                  "qwen3_5_moe", "llama_tied_llama3rope"])  # fmt: skip
def test_the_parameter_count_is_the_checkpoints(tiny_models, name):
    """`kiln info`'s parameter count against the tensors transformers saved."""
    from safetensors import safe_open

    from kiln.loader import open_model

    with safe_open(os.path.join(tiny_models[name], "model.safetensors"), "pt") as f:
        saved = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())  # noqa: SIM118
    assert open_model(tiny_models[name]).config.num_params == saved
