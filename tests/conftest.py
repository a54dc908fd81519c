"""Shared fixtures. Models load once per session: the embedded SmolLM2 GGUF (kiln and HF
transformers as the reference) and tiny random-weight HF directories per architecture."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from kiln.default_model import default_model_path

if not torch.cuda.is_available():
    # Triton kernels run in Triton's CPU interpreter here. Triton reads this when it decorates
    # its functions, so it must be set before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

# the hybrid models' layer pattern and Gated DeltaNet shape, and their experts
HYBRID_EXPERTS = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)  # fmt: skip
HYBRID_LINEAR = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)

TINY_VARIANTS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama_tied_llama3rope": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "llama_linear_rope": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen2_yarn": (
        "Qwen2Config",
        dict(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        ),
    ),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False)),
    # layer 0 sparse, layer 1 dense; top-2 of 4 experts with unnormalised weights
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
    ),
    # a Gated DeltaNet layer, then a gated-attention layer; experts with a shared expert
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(HYBRID_LINEAR, **HYBRID_EXPERTS),
    ),
    # Qwen3.5's text models: q/k/v, z, b and a projected apart; dense, and with experts
    "qwen3_5": ("Qwen3_5TextConfig", dict(HYBRID_LINEAR)),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        dict(HYBRID_LINEAR, **HYBRID_EXPERTS),
    ),
}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """The embedded model's tokenizer as an HF directory (converted once, cached); where the
    embedded model is not installed (the GPU machine), a file-less word-level tokenizer."""
    from kiln.errors import ModelLoadError
    from kiln.loader.tokenizer import (
        _convert_gguf_tokenizer,
        _converted_tokenizer_dir,
        word_level_tokenizer,
    )

    try:
        gguf_path = default_model_path()
    except ModelLoadError:
        path = str(tmp_path_factory.mktemp("word_level"))
        word_level_tokenizer(49152).save_pretrained(path)
        return path
    path = _converted_tokenizer_dir(gguf_path)
    if not os.path.isdir(path):
        _convert_gguf_tokenizer(gguf_path, path)
    return path


def make_tiny_model(root: str, name: str, tokenizer_dir: str, seed: int = 0) -> str:
    import transformers

    cls_name, extra = TINY_VARIANTS[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls_name)(
        vocab_size=49152, bos_token_id=1, eos_token_id=2, **TINY, **extra
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    path = os.path.join(root, name)
    model.save_pretrained(path)
    for f in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, f), path)
    with open(os.path.join(path, "config.json")) as fh:
        assert json.load(fh)["architectures"]
    return path


# Qwen3.5's image-text checkpoints (their text models are TINY_VARIANTS' qwen3_5 and
# qwen3_5_moe) with a one-block vision tower
VISION_LANGUAGE_VARIANTS = {"qwen3_5_vl": ("Qwen3_5Config", "qwen3_5"),
                            "qwen3_5_moe_vl": ("Qwen3_5MoeConfig", "qwen3_5_moe")}  # fmt: skip
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                   out_hidden_size=64, num_position_embeddings=16)  # fmt: skip


def make_tiny_vision_language_model(root: str, name: str, tokenizer_dir: str) -> str:
    import transformers

    cls_name, text_variant = VISION_LANGUAGE_VARIANTS[name]
    text = dict(vocab_size=49152, bos_token_id=1, eos_token_id=2, **TINY,
                **TINY_VARIANTS[text_variant][1])  # fmt: skip
    torch.manual_seed(0)
    cfg = getattr(transformers, cls_name)(text_config=text, vision_config=TINY_VISION)
    model = getattr(transformers, cls_name.replace("Config", "ForConditionalGeneration"))(cfg)
    path = os.path.join(root, name)
    model.save_pretrained(path)
    for f in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, f), path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("tiny"))
    return {name: make_tiny_model(root, name, tokenizer_dir) for name in TINY_VARIANTS}


@pytest.fixture(scope="session")
def smollm_llm(smollm_path):
    from kiln import LLM

    return LLM(kv_cache_memory="512MiB", max_num_seqs=16)


@pytest.fixture(scope="session")
def smollm_dense_llm(smollm_path):
    """The embedded model dequantized to float32 (--quantization none): HF's numbers, and
    greedy output that does not change with how requests are batched."""
    from kiln import LLM

    return LLM(kv_cache_memory="512MiB", max_num_seqs=16, quantization="none")


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(smollm_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_models(tiny_models):
    """HF transformers' own models for the tiny checkpoints: the reference logits."""
    from transformers import AutoModelForCausalLM

    return {
        name: AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        for name, path in tiny_models.items()
    }


# the packed tiny model's tensor types: attention Q4_0, MLP Q4_1, embedding and head Q8_0
PACKED_KINDS = {"self_attn": "Q4_0", "mlp": "Q4_1"}


def packed_kind(name: str):
    import gguf

    kind = next((k for part, k in PACKED_KINDS.items() if part in name), "Q8_0")
    return gguf.GGMLQuantizationType[kind]


@pytest.fixture(scope="session")
def packed_gguf(tiny_models, tmp_path_factory) -> str:
    """The tiny Llama as a GGUF of 4-bit-packable types (its tokenizer: tiny_models["llama"])."""
    from transformers import AutoModelForCausalLM

    from tests.gguf_files import write_gguf

    path = tmp_path_factory.mktemp("packed") / "tiny-packed.gguf"
    write_gguf(path, AutoModelForCausalLM.from_pretrained(tiny_models["llama"]), packed_kind)
    return str(path)


# llama.cpp's Q4_K_M and Q5_K_M files carry some tensors in Q6_K beside Q4_K or Q5_K ones: these
# of a Llama with 256 hidden units (the K-quants' blocks are 256 columns); the fused qkv has
# parts of two formats (Q4_K q and k, a Q6_K v), the fused gate_up is Q5_K
K_QUANT_MIX = {"v_proj": "Q6_K", "self_attn": "Q4_K", "down_proj": "Q6_K", "mlp": "Q5_K",
            "embed": "Q6_K", "lm_head": "Q6_K"}  # fmt: skip


def k_quant_mix_kind(name: str):
    import gguf

    return gguf.GGMLQuantizationType[next(k for part, k in K_QUANT_MIX.items() if part in name)]


def k_quant_mix_llama():
    """A random 2-layer Llama with 256 hidden units and its own head (seeded): wide enough for
    the K-quants, with the tiny models' vocabulary (their tokenizer)."""
    import transformers

    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=49152, bos_token_id=1, eos_token_id=2, **{
        **TINY, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64,
        "tie_word_embeddings": False,
    })  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def k_quant_mix_gguf(tmp_path_factory) -> str:
    """`k_quant_mix_llama` as a GGUF of K_QUANT_MIX's types (tokenizer: tiny_models["llama"])."""
    from tests.gguf_files import write_gguf

    path = tmp_path_factory.mktemp("packed") / "q6k-mix.gguf"
    write_gguf(path, k_quant_mix_llama(), k_quant_mix_kind)
    return str(path)


# a Q4_K_M/Q5_K_M-like Qwen3-MoE with 256 hidden units and 256 per expert: layer 0's experts
# Q4_K gate/up beside Q6_K down (Q4_K_M's more-bits layers), layer 1's Q5_K gate/up beside a
# Q4_K down; the routers float32 (as llama.cpp writes them), the rest Q4_K or Q6_K
K_QUANT_MOE = {"layers.0.mlp.stacked_down": "Q6_K", "layers.1.mlp.stacked_down": "Q4_K",
               "layers.1.mlp.stacked_": "Q5_K", "stacked_": "Q4_K", "mlp.gate.": "F32",
               "self_attn": "Q4_K", "": "Q6_K"}  # fmt: skip


def k_quant_moe_kind(name: str):
    import gguf

    return gguf.GGMLQuantizationType[next(k for part, k in K_QUANT_MOE.items() if part in name)]


def k_quant_moe_model():
    """A random 2-layer Qwen3-MoE (both layers sparse, top 2 of 4 experts) with 256 hidden units
    and 256 per expert (seeded): wide enough for the K-quants, the tiny models' vocabulary."""
    import transformers

    torch.manual_seed(2)
    cfg = transformers.Qwen3MoeConfig(vocab_size=49152, bos_token_id=1, eos_token_id=2, **{
        **TINY, "hidden_size": 256, "head_dim": 64, "tie_word_embeddings": False,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
    })  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def k_quant_moe_gguf(tmp_path_factory) -> str:
    """`k_quant_moe_model` as a qwen3moe GGUF of K_QUANT_MOE's types (tokenizer:
    tiny_models["qwen3_moe"])."""
    from tests.gguf_files import write_gguf

    path = tmp_path_factory.mktemp("packed") / "k-quant-moe.gguf"
    write_gguf(path, k_quant_moe_model(), k_quant_moe_kind, arch="qwen3moe")
    return str(path)


def packed_moe_kind(name: str):
    """The packed tiny Qwen3-MoE's tensor types: experts' gate and up Q4_1, their down Q8_0
    (two planes), attention Q4_0, the rest (router, dense MLP, embedding, head) Q8_0."""
    import gguf

    kinds = {"stacked_down": "Q8_0", "stacked_": "Q4_1", "self_attn": "Q4_0"}
    kind = next((k for part, k in kinds.items() if part in name), "Q8_0")
    return gguf.GGMLQuantizationType[kind]


@pytest.fixture(scope="session")
def packed_moe_gguf(tiny_models, tmp_path_factory) -> str:
    """The tiny Qwen3-MoE as a qwen3moe GGUF of 4-bit-packable types (`packed_moe_kind`)."""
    from transformers import AutoModelForCausalLM

    from tests.gguf_files import write_gguf

    path = tmp_path_factory.mktemp("packed") / "tiny-packed-moe.gguf"
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3_moe"])
    write_gguf(path, hf, packed_moe_kind, arch="qwen3moe")
    return str(path)


@pytest.fixture(scope="session")
def mtp_models(tiny_models, tmp_path_factory) -> dict[str, str]:
    """The tiny hybrids with an MTP head: with experts (qwen3_next) and dense (qwen3_5)."""
    root = tmp_path_factory.mktemp("mtp")
    from tests.helpers import add_mtp_head

    names = ("qwen3_next", "qwen3_5")
    return {name: add_mtp_head(tiny_models[name], str(root / name)) for name in names}


@pytest.fixture(params=["native", "avx2"])
def kernel_build(request, monkeypatch):
    """kiln's packed-weight kernels as this CPU builds them (native), or as a CPU with AVX2 and
    FMA but no AVX-512 builds them (avx2: -mavx2 -mfma for -march=native, where this CPU has
    both): the engine then runs the Q6_K and K-quant kernels' AVX2 paths and the int4 kernel's
    float rows."""
    from kiln import native
    from kiln.layers import int4_kernel, kquant_kernel, q6k_kernel

    if request.param == "native":
        yield request.param
        return
    if not native.runs_avx2():
        pytest.skip("this CPU has no AVX2 with FMA")
    flags = native.AVX2_FLAGS
    factories = [int4_kernel.int4_matmul_kernel, kquant_kernel.kquant_matmul_kernel,
                 q6k_kernel.q6k_matmul_kernel]  # fmt: skip
    for module in (int4_kernel, kquant_kernel, q6k_kernel):
        monkeypatch.setattr(module, "FLAGS", flags)
    for factory in factories:
        factory.cache_clear()
    yield request.param
    monkeypatch.undo()
    for factory in factories:
        factory.cache_clear()
