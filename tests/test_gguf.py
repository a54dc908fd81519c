"""GGUF reading: llama.cpp's q/k permutation undone, every common tensor type dequantized,
metadata turned into the model config."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.errors import ModelLoadError
from kiln.loader.gguf import GGUFSource, dequantize
from kiln.loader.gguf_file import GGUFFile
from tests.gguf_files import write_gguf

T = gguf.GGMLQuantizationType
# (type, tolerance relative to the tensor's max magnitude)
TYPES = [(T.F32, 0), (T.F16, 1e-3), (T.BF16, 1e-2), (T.Q8_0, 1e-2), (T.Q4_0, 0.15), (T.Q4_1, 0.1)]


@pytest.mark.parametrize("kind,tol", TYPES, ids=[t.name for t, _ in TYPES])
def test_tensors_round_trip(tiny_models, tmp_path, kind, tol):
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, lambda name: kind)
    src = GGUFSource(str(path))
    assert src.config.num_layers == 2 and src.config.num_kv_heads == 2
    assert src.config.tie_word_embeddings is False
    ref = hf.state_dict()
    loaded = dict(src.tensors(torch.float32))
    assert set(loaded) == set(ref)
    for name, tensor in loaded.items():
        r = ref[name]
        torch.testing.assert_close(tensor, r, atol=tol * r.abs().max().item() + 1e-7, rtol=0)


def test_gguf_model_logits_match_hf(tiny_models, tmp_path):
    """The whole path (metadata, names, permutation) through kiln's model, F32 weights."""
    from kiln.models import build_model
    from kiln.models.weights import load_weights
    from tests.helpers import make_engine

    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"]).eval()
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, lambda name: T.F32)
    engine = make_engine(tiny_models["llama"])  # the runner drives a GGUF-loaded model below
    src = GGUFSource(str(path))
    model = build_model(src.config, engine.runner.attn_backend)
    load_weights(model, src.tensors(torch.float32))
    model.finalize(torch.device("cpu"))
    engine.runner.model, engine.runner.forward = model, model.forward  # mode 0: eager
    engine.runner.allocate_kv_cache(engine.blocks.num_blocks, torch.float32)
    ids = [5, 17, 300, 4000, 12, 9]
    engine.add_request("g", ids, __import__("kiln").SamplingParams(temperature=0, max_tokens=1))
    rows = []
    engine.runner.logits_observer = lambda seqs, logits: rows.append(logits[0].clone())
    while engine.has_unfinished_requests():
        engine.step()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(rows[0], ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def _k_quant_file(tmp_path):
    """One 256-value block each of Q4_K and Q6_K, built by hand from the ggml block layouts."""
    # Q4_K: d=0.5, dmin=0.25 (fp16); 12 bytes of 6-bit scales/mins: every sub-block scale 2, min 1;
    # 128 bytes of 4-bit quants, all 3. Value = d * scale * q - dmin * min = 0.5*2*3 - 0.25 = 2.75
    q4k = np.zeros(144, dtype=np.uint8)
    q4k[0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    q4k[2:4] = np.frombuffer(np.float16(0.25).tobytes(), np.uint8)
    q4k[4:8] = 2  # scales of sub-blocks 0-3
    q4k[8:12] = 1  # mins of sub-blocks 0-3
    q4k[12:16] = 0x12  # sub-blocks 4-7: scale in the low nibble (2), min in the high (1)
    q4k[16:] = 0x33
    # Q6_K: 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, d (fp16).
    # q = 40 everywhere (low nibble 8, high bits 2); value = d * scale * (q - 32) = 0.5 * 3 * 8 = 12
    q6k = np.zeros(210, dtype=np.uint8)
    q6k[0:128] = 0x88
    q6k[128:192] = 0b10101010
    q6k[192:208] = 3
    q6k[208:210] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_tensor("q4k", q4k[None, :], raw_dtype=T.Q4_K)
    w.add_tensor("q6k", q6k[None, :], raw_dtype=T.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(str(tmp_path / "k.gguf"))


def test_k_quants_dequantize_to_hand_computed_values(tmp_path):
    reader = _k_quant_file(tmp_path)
    tensors = {t.name: dequantize(t) for t in reader.tensors}
    np.testing.assert_allclose(tensors["q4k"], np.full((1, 256), 2.75, np.float32))
    np.testing.assert_allclose(tensors["q6k"], np.full((1, 256), 12.0, np.float32))


def test_unsupported_tensor_type_is_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    w.add_tensor("iq", np.zeros((1, 66), np.uint8), raw_dtype=T.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = GGUFFile(str(tmp_path / "iq.gguf")).tensors[0]
    with pytest.raises(ModelLoadError, match=r"IQ2_XXS.*Q4_K"):
        dequantize(t)


def _assert_reads_as_gguf_py_does(path) -> None:
    """kiln's header reader against gguf-py's GGUFReader: every field's value, and every
    tensor's name, type, shape and bytes."""
    ours, ref = GGUFFile(str(path)), gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected
    assert [type(v) for v in ours.fields.values()] == [type(v) for v in expected.values()]
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, tuple(b.shape.tolist()))
        assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape)
        assert a.data.tobytes() == b.data.tobytes()


def test_header_reader_reads_the_embedded_model_as_gguf_py_does(smollm_path):
    _assert_reads_as_gguf_py_does(smollm_path)


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_header_reader_reads_every_value_type_as_gguf_py_does(tmp_path, endian):
    path = tmp_path / f"all-{endian.name}.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**63)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "Ġthe", "日本"])
    w.add_array("t.empty", [])
    w.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    data = rng.standard_normal((4, 256)).astype(np.float32)
    for kind in (T.F32, T.F16, T.Q8_0, T.Q4_1):
        q = data if kind == T.F32 else gguf.quants.quantize(data, kind)
        w.add_tensor(f"w.{kind.name}", q, raw_dtype=kind)
    q6k = rng.integers(0, 256, (4, 210), dtype=np.uint8)  # a K-quant's blocks, as bytes
    w.add_tensor("w.Q6_K", q6k, raw_dtype=T.Q6_K)
    w.add_tensor("w.i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_reads_as_gguf_py_does(path)
    if endian is gguf.GGUFEndian.LITTLE:  # dequantized through kiln's loader as well
        ours = {t.name: t for t in GGUFFile(str(path)).tensors}
        np.testing.assert_array_equal(dequantize(ours["w.F32"]), data)


def test_files_that_are_not_gguf_are_refused_by_path(tmp_path):
    good = tmp_path / "good.gguf"
    w = gguf.GGUFWriter(str(good), "llama")
    w.add_tensor("wa", np.ones((2, 32), np.float32))
    w.add_tensor("wb", np.ones((2, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    raw = good.read_bytes()
    cases = {
        "text.gguf": (b"not a model at all", "no GGUF magic"),
        "truncated.gguf": (raw[: len(raw) - 16], "tensor 'wb' runs past the end"),
        "version9.gguf": (raw[:4] + (9).to_bytes(4, "little") + raw[8:], "GGUF version 9"),
        "twice.gguf": (raw.replace(b"wb", b"wa", 1), r"tensors \['wa'\] appear more than once"),
    }
    for name, (content, why) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ModelLoadError, match=f"{name}' is not a readable GGUF file: {why}"):
            GGUFSource(str(tmp_path / name))


def test_hybrid_column_reorder_keeps_whole_groups_quantized():
    """Qwen3.5's out_proj columns go back to HF's order: where value heads are whole groups the
    codes and their scales move together and stay quantized; otherwise dequantized, same values."""
    from kiln.layers.packed import Int4Codes, QuantizedTensor
    from kiln.loader.gguf_hybrid import _columns

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (8, 128), dtype=torch.uint8, generator=g)
    t = QuantizedTensor("Q4_0", [Int4Codes(codes, torch.rand(8, 4, generator=g),
                                           torch.rand(8, 4, generator=g), 32)])  # fmt: skip
    whole_groups = torch.cat([torch.arange(64, 96), torch.arange(0, 64), torch.arange(96, 128)])
    moved = _columns(t, whole_groups)
    assert isinstance(moved, QuantizedTensor)
    torch.testing.assert_close(moved.dequantize(), t.dequantize()[:, whole_groups], rtol=0, atol=0)
    split_groups = torch.cat([torch.arange(8, 128), torch.arange(0, 8)])
    dense = _columns(t, split_groups)
    assert isinstance(dense, torch.Tensor)
    torch.testing.assert_close(dense, t.dequantize()[:, split_groups], rtol=0, atol=0)


# the tiny hybrids' widths (48) are no multiple of Q4_0's 32-column blocks: F32 only
FUSED_FILES = [(name, arch, kind) for name, arch in (("llama", "llama"), ("qwen2", "qwen2"),
                                                    ("qwen3_moe", "qwen3moe"))
               for kind in (T.F32, T.Q4_0)] + [
    ("qwen3_next", "qwen3next", T.F32), ("qwen3_5", "qwen35", T.F32),
    ("qwen3_5_moe", "qwen35moe", T.F32)]  # fmt: skip


@pytest.mark.parametrize("name, arch, kind", FUSED_FILES,
                         ids=[f"{arch}-{kind.name}" for _, arch, kind in FUSED_FILES])  # fmt: skip
def test_fused_projections_read_back_apart(tiny_models, tmp_path, kind, name, arch):
    """A file from llama.cpp's converter with --fuse-qkv and --fuse-gate-up-exps (`attn_qkv`:
    q, k and v along the rows, Llama's q and k permuted, Qwen2's biases too, a gated
    attention's q with its gates; `ffn_gate_up_exps`: each expert's gate then up) gives the
    config and every tensor of the unfused file, dense and as 4-bit planes; a hybrid's Gated
    DeltaNet layers keep their own `attn_qkv`."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_models[name])
    paths = {fuse: tmp_path / f"{fuse}.gguf" for fuse in (False, True)}
    for fuse, path in paths.items():
        write_gguf(path, hf, lambda _: kind, arch=arch, fuse=fuse)
    names = {t.name.split(".")[-2] for t in GGUFFile(str(paths[True])).tensors}
    assert "attn_qkv" in names and "attn_q" not in names
    assert ("ffn_gate_up_exps" in names) == (arch in ("qwen3moe", "qwen3next", "qwen35moe"))
    fused, apart = GGUFSource(str(paths[True])), GGUFSource(str(paths[False]))
    assert fused.config == apart.config
    attention = {f"model.layers.{i}." for i in fused.config.attention_layer_ids}
    for keep_packed in (False, True):
        ours = dict(fused.tensors(torch.float32, keep_packed))
        theirs = dict(apart.tensors(torch.float32, keep_packed))
        assert ours.keys() == theirs.keys()
        # q, k and v only where there is attention (a DeltaNet's attn_qkv is its own)
        assert all(k.startswith(tuple(attention)) for k in ours if ".self_attn." in k
                   and k.startswith("model."))  # fmt: skip
        for key, tensor in ours.items():
            if isinstance(tensor, torch.Tensor):
                assert torch.equal(tensor, theirs[key]), key
                continue
            for plane, their_plane in zip(tensor.planes, theirs[key].planes, strict=True):
                for field in ("codes", "scale", "zero"):
                    assert torch.equal(getattr(plane, field), getattr(their_plane, field)), key
