"""Dense copies of packed weights (`--prefill-weights`): the op's two paths against the
dequantized reference, which layers get copies under each policy, and a packed bf16 model's
logits with copies against the same model without them."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import ConfigError
from kiln.layers.bf16_kernel import bf16_matmul_kernel, pack_pairs
from kiln.layers.cpu_int4_layout import cpu_block_n
from kiln.layers.int4_kernel import int4_matmul_kernel
from kiln.layers.linear import onednn_runs, prepack_for_cpu
from kiln.layers.packed import (
    DENSE_MIN_ROWS,
    DEQUANT_MIN_ROWS,
    INT8_COPY_MIN_ROWS,
    PAIRS_MIN_ROWS,
    PackedInt4,
)
from kiln.models.weights import describe_weights
from tests.helpers import make_engine
from tests.test_packed import BF16_ULP, CPU, _gguf_tensor

needs_bf16_onednn = pytest.mark.skipif(
    not onednn_runs(torch.bfloat16), reason="this CPU has no native oneDNN bf16 kernels"
)


COPIES = {"onednn": (prepack_for_cpu, DENSE_MIN_ROWS), "pairs": (pack_pairs, PAIRS_MIN_ROWS)}


@needs_bf16_onednn
@pytest.mark.parametrize("copy", ["onednn", "pairs"])
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, DENSE_MIN_ROWS - 1, DENSE_MIN_ROWS, 300])
@pytest.mark.parametrize("int8_planes", [0, 2])
def test_dense_copy_matches_the_dequantized_matmul(copy, kind, rows, int8_planes):
    """Either copy (kiln's bf16 kernel's pairs, oneDNN's layout) from its switch on, the int4
    planes below it: the pairs from 2 rows, or from INT8_COPY_MIN_ROWS where one plane's rows
    go in as int8 planes (Q8_0's two planes: from 2)."""
    if copy == "pairs" and bf16_matmul_kernel() is None:
        pytest.skip("kiln's bf16 kernel needs AVX512-BF16")
    kernel = int4_matmul_kernel()
    if int8_planes and not (kernel is not None and kernel.int8_rows_for(cpu_block_n())):
        pytest.skip("kiln's int4 kernel has no int8 path here (AVX512-VNNI with VBMI, or AVX2)")
    pack, switch = COPIES[copy]
    if copy == "pairs" and int8_planes and kind != "Q8_0":
        switch = INT8_COPY_MIN_ROWS
    n, k = 100, 512  # 100 rows: the planes and the copy are padded to 128
    ref_w, planes = _gguf_tensor(kind, n, k)
    with_copy, without = PackedInt4(planes, CPU), PackedInt4(planes, CPU)
    with_copy.int8_planes = without.int8_planes = int8_planes
    with_copy.keep_dense_copy(pack(with_copy.dense_weight(torch.bfloat16)))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = with_copy(x)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    ref = x.float() @ torch.from_numpy(ref_w).t()
    tol = 8 * BF16_ULP * ref.abs().max().item()
    torch.testing.assert_close(y.float(), ref, rtol=0, atol=tol)
    if (
        rows < DEQUANT_MIN_ROWS
    ):  # below the switch the int4 kernel's very values, from it the copy's
        assert torch.equal(y, without(x)) == (rows < switch)


def _copies(engine) -> list[bool]:
    packed = [m for m in engine.runner.model.modules() if isinstance(m, PackedInt4)]
    return [m.dense is not None for m in packed]


@needs_bf16_onednn
def test_a_bf16_model_keeps_copies_and_computes_the_same_logits(tiny_models, packed_gguf):
    from kiln import SamplingParams
    from tests.helpers import run_schedule

    prompt = [(7 * i + 3) % 900 for i in range(40)]  # a 40-row prefill: the dense path
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    logits = {}
    for policy in ("auto", "packed"):
        engine = make_engine(packed_gguf, dtype="bfloat16", tokenizer=tiny_models["llama"],
                             prefill_weights=policy)  # fmt: skip
        # 2 layers x 4 linears and the (untied) head; the embedding is only looked up
        assert sum(_copies(engine)) == (9 if policy == "auto" else 0)
        assert ("dense bfloat16 copy" in describe_weights(engine.runner.model.weight_summary)) == (
            policy == "auto"
        )
        _, recorded = run_schedule(engine, [(0, prompt, params)], record_logits=True)
        logits[policy] = recorded["0"][0].float()  # the prefill's logits
        engine.close()
    # the copy is the dequantized weight rounded to bf16 once; without it each chunk rounds
    # the same dequantized values the same way: equal up to the matmuls' summation order
    ref = logits["packed"]
    torch.testing.assert_close(logits["auto"], ref, rtol=0, atol=8 * BF16_ULP * ref.abs().max())


def test_a_float32_model_keeps_no_copies_and_dense_says_why(tiny_models, packed_gguf):
    engine = make_engine(packed_gguf, tokenizer=tiny_models["llama"])
    assert not any(_copies(engine)) and len(_copies(engine)) == 10
    engine.close()
    with pytest.raises(ConfigError, match="a float32 model dequantizes each weight"):
        make_engine(packed_gguf, tokenizer=tiny_models["llama"], prefill_weights="dense")


@needs_bf16_onednn
def test_compiled_bf16_packed_model_with_copies_matches_eager(tiny_models, packed_gguf):
    """Mode 3 calls the op with its copy as a graph input (chunks of 16 rows take the copy,
    single decodes the int4 kernel): eager's greedy tokens up to a near tie (this tiny random
    model's bf16 logits tie exactly at some steps), logits within bf16 rounding."""
    from kiln.config.compilation import CompilationConfig
    from tests.test_compiled import _assert_matches_eager

    kwargs = dict(block_size=4, max_num_batched_tokens=16, dtype="bfloat16",
                  tokenizer=tiny_models["llama"])  # fmt: skip
    eager = make_engine(packed_gguf, **kwargs)
    config = CompilationConfig(mode=3, splitting_ops=())
    compiled = make_engine(packed_gguf, **kwargs, compilation=config)
    assert sum(_copies(compiled)) == 9
    _assert_matches_eager(eager, compiled, rtol=0, atol=4 * BF16_ULP, near_ties=True)
    assert compiled.runner.compile_backend.stats.trace in ("traced and saved", "loaded")


@needs_bf16_onednn
def test_auto_short_of_memory_warns_and_keeps_none(tiny_models, packed_gguf, monkeypatch, caplog):
    import kiln.boot.prefill_weights as prefill_weights

    monkeypatch.setattr(prefill_weights, "available_memory", lambda device: 1 << 20)  # 1 MiB free
    engine = make_engine(packed_gguf, dtype="bfloat16", tokenizer=tiny_models["llama"])
    assert not any(_copies(engine))
    assert "Remedy: --prefill-weights dense" in caplog.text
    engine.close()
    dense = make_engine(packed_gguf, dtype="bfloat16", tokenizer=tiny_models["llama"],
                        prefill_weights="dense")  # fmt: skip
    assert sum(_copies(dense)) == 9  # dense asks no memory question
    dense.close()
