"""Experts kept 4-bit packed (kiln/layers/packed_experts.py): the packed product against a
per-token computation on the `gguf` package's dequantized values, the stacks that cannot be
packed and the reason each records, and a packed Qwen3-MoE GGUF against HF transformers on the
same dequantized weights. The GPTQ form is in test_gptq.py, the graph modes in test_graphs.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from kiln.layers.int4_kernel import int4_matmul_kernel
from kiln.layers.kquant_kernel import kquant_matmul_kernel
from kiln.layers.moe import FusedExperts
from kiln.layers.packed import Int4Codes, QuantizedTensor
from kiln.layers.packed_experts import (
    KQUANT_FORM,
    Q6K_FORM,
    PackedExperts,
    nibble_dequantize,
    nibble_plane,
    unpackable_reason,
)
from kiln.layers.q6k_kernel import q6k_matmul_kernel
from kiln.loader.gguf_quant import gguf_codes
from tests.conftest import k_quant_moe_kind, packed_moe_kind
from tests.gguf_files import quantize, quantize_q5_k, quantize_q6_k

T = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
BF16_ULP = 2**-8
E, H, I = 3, 256, 256  # noqa: E741 - the intermediate size; Q4_K needs 256 columns


def _q4_k(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K rows (the gguf package has no Q4_K quantizer), d and dmin small."""
    blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    for at in (0, 2):
        d = rng.uniform(1e-3, 1e-2, (n, k // 256)).astype(np.float16)
        blocks[..., at : at + 2] = d.view(np.uint8).reshape(n, k // 256, 2)
    return blocks.reshape(n, -1)


def _quantized(kind: str, n: int, k: int, rng: np.random.Generator):
    """(the gguf package's dequantized float32 [n, k], kiln's codes as the loader reads them)
    of one random matrix; "Q4_K-int4": Q4_K read as an int4 plane (as GPTQ's planes are)."""
    base = kind.removesuffix("-int4")
    if base == "Q4_K":
        data = _q4_k(n, k, rng)
    elif base == "Q5_K":  # the gguf package has no Q5_K quantizer
        data = quantize_q5_k(rng.standard_normal((n, k)).astype(np.float32) * 0.1)
    elif base == "Q6_K":
        data = quantize_q6_k(rng.standard_normal((n, k)).astype(np.float32) * 0.1)
    else:
        data = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.1, T[base])
    ref = torch.from_numpy(gguf.quants.dequantize(data, T[base]).copy())
    return ref, gguf_codes(base, data, (n, k), exact_q4_k=kind == "Q4_K")


def _kernel_form(kind: str) -> int | None:
    """The form kind's experts take where kiln's Q6_K or K-quant kernel runs them, else None
    (int4 planes)."""
    if kind == "Q6_K":
        return Q6K_FORM
    return KQUANT_FORM if kind in ("Q4_K", "Q5_K") else None


def _kernel_runs(form: int) -> bool:
    return (q6k_matmul_kernel() if form == Q6K_FORM else kquant_matmul_kernel()) is not None


def _kernel_layouts_isa(form: int) -> int:
    """The vector path of the kernel that runs `form`'s stacks (q6k or K-quant)."""
    return (q6k_matmul_kernel() if form == Q6K_FORM else kquant_matmul_kernel()).isa


@pytest.fixture(params=[True, False], ids=["kernels", "no-kernels"])
def kernels(request, monkeypatch) -> bool:
    """Whether kiln's Q6_K and K-quant kernels run: as this CPU has them, or (False) as on a
    CPU without AVX2 or a compiler, where the loader's checks find no kernel."""
    import kiln.layers.packed as packed

    if not request.param:
        monkeypatch.setattr(packed, "q6k_matmul_kernel", lambda: None)
        monkeypatch.setattr(packed, "kquant_matmul_kernel", lambda: None)
    return request.param and _kernel_runs(Q6K_FORM) and _kernel_runs(KQUANT_FORM)


def _experts(kinds: list, seed: int = 0, device: torch.device = CPU):
    """FusedExperts loaded with expert e's three parts in `kinds[e]` (None: dense float32; a
    tuple: gate, up and down each its own), and the float32 reference stacks (on the CPU)."""
    rng = np.random.default_rng(seed)
    with device:
        experts = FusedExperts(len(kinds), H, I)
    gate_up, down = torch.empty(len(kinds), 2 * I, H), torch.empty(len(kinds), H, I)
    for e, kinds_of_expert in enumerate(kinds):
        for i, (proj, (n, k), rows) in enumerate((("gate_proj", (I, H), gate_up[e, :I]),
                                                  ("up_proj", (I, H), gate_up[e, I:]),
                                                  ("down_proj", (H, I), down[e]))):  # fmt: skip
            kind = kinds_of_expert[i] if isinstance(kinds_of_expert, tuple) else kinds_of_expert
            if kind is None:
                rows.copy_(torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)))
                experts.load_dense(e, proj, rows)
                continue
            ref, planes = _quantized(kind, n, k, rng)
            rows.copy_(ref)
            experts.load_quantized(e, proj, planes)
    experts.finalize(device)
    return experts, gate_up, down


def _per_token(x, gate_up, down, ids, weights) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate, up = (gate_up[ids[t, j]] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (down[ids[t, j]] @ (F.silu(gate) * up))
    return out


def _routing(tokens: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.rand(tokens, E, generator=g).topk(2, dim=-1).indices
    ids[: tokens // 2, 0] = 0  # expert 0 takes half of the rows: past the dequant switch
    return x, ids, torch.rand(tokens, 2, generator=g)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K-int4", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 600])  # 600: the dense path for expert 0
def test_packed_experts_equal_the_dequantized_experts(kind, dtype, tokens, kernel_build):
    """int4 planes, and Q6_K, Q5_K and Q4_K on kiln's own kernels (exact codes, the rows as two
    int8 planes) where this CPU runs them (test_without_the_kernels_... below: where not), built
    for this CPU and for AVX2 without AVX-512 (`kernel_build`)."""
    if kernel_build == "avx2" and _kernel_form(kind) is not None:
        assert _kernel_layouts_isa(_kernel_form(kind)) == 1
    experts, gate_up, down = _experts([kind] * E)
    _assert_stacks(experts, kind, _kernel_form(kind) is None or _kernel_runs(_kernel_form(kind)))
    x, ids, weights = _routing(tokens)
    y = experts(x.to(dtype), ids, weights.to(dtype))
    assert y.shape == x.shape and y.dtype == dtype
    ref = _per_token(x, gate_up, down, ids, weights)
    # bf16 scales, bf16 outputs of both products (and bf16 activations in a bf16 model): a few
    # bf16 ulps of the output's magnitude; a wrong code order or expert is off by the magnitude
    tol = (8 if dtype == torch.float32 else 16) * BF16_ULP * ref.abs().max().item()
    torch.testing.assert_close(y.float(), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_without_the_kernels_q4_k_experts_are_int4_planes_and_the_rest_dense(kind, monkeypatch):
    """Where the Q6_K and K-quant kernels do not run (no AVX2, no compiler): Q4_K experts become
    int4 planes, Q6_K and Q5_K ones are dequantized, saying why; the product is the same within
    the planes' bf16 scales."""
    import kiln.layers.packed as packed

    monkeypatch.setattr(packed, "q6k_matmul_kernel", lambda: None)
    monkeypatch.setattr(packed, "kquant_matmul_kernel", lambda: None)
    experts, gate_up, down = _experts([kind] * E)
    _assert_stacks(experts, kind, kernels=False)
    x, ids, weights = _routing(5)
    ref = _per_token(x, gate_up, down, ids, weights)
    tol = 8 * BF16_ULP * ref.abs().max().item()
    torch.testing.assert_close(experts(x, ids, weights), ref, rtol=0, atol=tol)


def _assert_stacks(experts, kind: str, kernels: bool) -> None:
    """The stacks `kind`'s experts make, with or without the Q6_K and K-quant kernels."""
    form = _kernel_form(kind)
    if form is None:
        return _assert_int4_stacks(experts, kind)
    if not kernels and kind == "Q4_K":
        assert [experts.packed[s].form for s in ("gate_up_proj", "down_proj")] == [32] * 2
    elif not kernels:
        assert not experts.packed and "AVX2 with FMA" in experts.fallback_reasons["down_proj"]
        return
    else:
        assert [experts.packed[s].form for s in ("gate_up_proj", "down_proj")] == [form] * 2
        bits = kind[1]
        assert experts.packed["down_proj"].describe() == f"{bits}-bit packed (Q{bits}_K's layout)"
    assert experts.gate_up_proj is None and experts.down_proj is None  # no dense stacks kept


def _assert_int4_stacks(experts, kind: str) -> None:
    assert set(experts.packed) == {"gate_up_proj", "down_proj"}
    assert isinstance(experts.packed["down_proj"], PackedExperts)
    assert experts.packed["down_proj"].num_planes == (2 if kind == "Q8_0" else 1)
    # the zeros of Q4_0 and of Q8_0's high plane are all 0: those tables keep the scales alone
    # (where kiln's kernel runs them)
    widths = [sz.shape[-1] for sz in experts.packed["down_proj"].planes()[1]]
    expected = {"Q4_0": [1], "Q4_K-int4": [2], "Q8_0": [1, 2]}[kind]
    assert widths == (expected if int4_matmul_kernel() is not None else [2] * len(expected))


@pytest.mark.parametrize("with_zeros", [[False, True, True], [True, False, False]])
def test_experts_with_and_without_zeros_share_a_stack_of_pairs(with_zeros):
    """Experts whose planes have no zeros beside experts whose planes do: a stack started as
    scales alone is widened to pairs when an expert with zeros arrives, without losing the
    experts before it; an expert without zeros after one with them is written as pairs."""
    if int4_matmul_kernel() is None:
        pytest.skip("kiln's int4 kernel is not built here: every table is pairs")
    g = torch.Generator().manual_seed(4)
    with CPU:
        experts = FusedExperts(E, H, I)
    gate_up, down = torch.empty(E, 2 * I, H), torch.empty(E, H, I)
    for e in range(E):
        for proj, (n, k), rows in (("gate_proj", (I, H), gate_up[e, :I]),
                                   ("up_proj", (I, H), gate_up[e, I:]),
                                   ("down_proj", (H, I), down[e])):  # fmt: skip
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
            scale = torch.rand(n, k // 32, generator=g) * 0.1
            zero = torch.randn(n, k // 32, generator=g) * 0.1 * with_zeros[e]
            t = QuantizedTensor("test", [Int4Codes(codes, scale, zero, 32)])
            rows.copy_(t.dequantize())
            experts.load_quantized(e, proj, t)
    experts.finalize(CPU)
    assert [s.shape[-1] for s in experts.packed["down_proj"].planes()[1]] == [2]
    x, ids, weights = _routing(5)
    ref = _per_token(x, gate_up, down, ids, weights)
    tol = 8 * BF16_ULP * ref.abs().max().item()
    torch.testing.assert_close(experts(x, ids, weights), ref, rtol=0, atol=tol)


def test_experts_of_different_formats_stay_dense_and_say_why():
    experts, gate_up, down = _experts(["Q4_0", "Q8_0", "Q4_0"])
    assert not experts.packed
    assert experts.fallback_reasons == dict.fromkeys(
        ("gate_up_proj", "down_proj"), "its experts arrived in different quantized formats"
    )
    # expert 0 was packed before expert 1 arrived: it comes back with the bf16 scales it was
    # packed with; the others are exact
    _assert_equal_but_packed_scales(experts, gate_up, down, packed_first=[0])


def test_a_dense_expert_among_quantized_ones_dequantizes_the_stack():
    experts, gate_up, down = _experts(["Q4_1", None, "Q4_1"])
    assert not experts.packed and not experts.packers
    assert experts.fallback_reasons["down_proj"] == "not every expert arrived quantized"
    # the dense expert made the stacks dense at once: expert 2 was never packed
    _assert_equal_but_packed_scales(experts, gate_up, down, packed_first=[0])


def test_gate_and_up_of_different_formats_make_their_stack_dense():
    """A gate part in Q4_0 and its up part in Q8_0 (two planes) cannot share one packed
    matrix: the gate/up stack is dequantized, exactly (nothing was packed), the down stack
    stays packed."""
    experts, gate_up, down = _experts([("Q4_0", "Q8_0", "Q4_0")] * E)
    assert set(experts.packed) == {"down_proj"}
    reason = experts.fallback_reasons["gate_up_proj"]
    assert "gate_proj and up_proj parts are in different" in reason
    assert torch.equal(experts.gate_up_proj, gate_up)
    x, ids, weights = _routing(7)
    ref = _per_token(x, gate_up, down, ids, weights)
    tol = 8 * BF16_ULP * ref.abs().max().item()
    torch.testing.assert_close(experts(x, ids, weights), ref, rtol=0, atol=tol)


def test_a_q5_k_gate_beside_a_q4_k_up_makes_the_stack_dense():
    """A Q5_K part beside a Q4_K one (5 and 4 bits on the K-quant kernel, or Q5_K's codes beside
    an int4 plane): not one form, so the gate/up stack is dequantized exactly and says why; the
    Q4_K down stack stays packed."""
    experts, gate_up, down = _experts([("Q5_K", "Q4_K", "Q4_K")] * E)
    assert set(experts.packed) == {"down_proj"}
    assert "parts are in different" in experts.fallback_reasons["gate_up_proj"]
    assert torch.equal(experts.gate_up_proj, gate_up)
    x, ids, weights = _routing(7)
    ref = _per_token(x, gate_up, down, ids, weights)
    tol = 8 * BF16_ULP * ref.abs().max().item()
    torch.testing.assert_close(experts(x, ids, weights), ref, rtol=0, atol=tol)


@pytest.mark.parametrize(("kinds", "forms", "without"), [
    (("Q4_K", "Q4_K", "Q6_K"), [KQUANT_FORM, Q6K_FORM], [32, None]),
    (("Q5_K", "Q5_K", "Q4_0"), [KQUANT_FORM, 32], [None, 32]),
])  # fmt: skip
def test_each_stack_takes_its_own_kernel(kinds, forms, without, kernels):
    """A Q4_K_M file's layer: Q4_K gate/up on the K-quant kernel beside Q6_K down experts on
    the Q6_K kernel; a Q5_K_M one's Q5_K gate/up beside an int4 (Q4_0) down stack. Each stack
    keeps its form (`without` the kernels: int4 planes, or None, dense), and the product
    matches the per-token reference."""
    experts, gate_up, down = _experts([kinds] * E)
    got = [experts.packed[s].form if s in experts.packed else None
           for s in ("gate_up_proj", "down_proj")]  # fmt: skip
    assert got == (forms if kernels else without)
    x, ids, weights = _routing(7)
    ref = _per_token(x, gate_up, down, ids, weights)
    tol = 8 * BF16_ULP * ref.abs().max().item()
    torch.testing.assert_close(experts(x, ids, weights), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("kind", ["Q6_K", "Q5_K", "Q4_K", "Q4_0", "Q4_K-int4", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_call_for_a_steps_experts_equals_a_call_per_expert(kind, dtype):
    """The kernels' grouped entries (every active expert of a projection in one call; Q8_0's
    two planes one call each) give each group's rows exactly what the product of that expert
    alone gives, in each dtype (fp16 rows rounded as the single call rounds them) and with the
    rows as float32 (int4 planes) or one or two int8 planes; rows of no group are zeros, and
    groups that overlap are refused before the C code sees them."""
    from kiln.layers.expert_groups import ExpertGroups
    from kiln.layers.packed_experts_op import _expert_product, _one_call

    form = _kernel_form(kind)
    runs = _kernel_runs(form) if form is not None else int4_matmul_kernel() is not None
    if not runs:
        pytest.skip("no kiln kernel for this form on this CPU")
    experts, _, _ = _experts([kind] * E)
    stack = experts.packed["gate_up_proj"]
    rows = torch.randn(9, H, generator=torch.Generator().manual_seed(3)).to(dtype)
    groups = ExpertGroups(experts=[0, 2], starts=[0, 3], counts=[3, 5])  # row 8: no group
    for planes in (0, 1, 2):
        got = _one_call(rows, stack.planes(), stack.form, groups, planes)
        assert got is not None
        for e, start, count in zip(groups.experts, groups.starts, groups.counts):
            alone = _expert_product(rows[start : start + count], *stack.planes(), stack.form, e,
                                    2 * I, planes)  # fmt: skip
            assert torch.equal(got[start : start + count, : 2 * I].to(dtype), alone)
        assert not got[8].any()
    overlapping = ExpertGroups(experts=[0, 2], starts=[0, 2], counts=[3, 5])
    with pytest.raises(ValueError, match="do not fit"):
        _one_call(rows, stack.planes(), stack.form, overlapping, 2)


def test_a_q4_k_gate_beside_a_q4_0_up_share_int4_planes():
    """Q4_K read for the K-quant kernel beside a Q4_0 part: both become int4 planes of group
    32, one packed stack, rather than a dense one."""
    experts, gate_up, down = _experts([("Q4_K", "Q4_0", "Q4_K")] * E)
    assert experts.packed["gate_up_proj"].form == 32
    assert experts.packed["gate_up_proj"].kind == "Q4_0+Q4_K"
    x, ids, weights = _routing(7)
    ref = _per_token(x, gate_up, down, ids, weights)
    tol = 8 * BF16_ULP * ref.abs().max().item()
    torch.testing.assert_close(experts(x, ids, weights), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("kind", ["Q6_K", "Q5_K"])
def test_kernel_experts_packed_before_a_dense_one_come_back_exact(kind):
    """Expert 0 packed on its kernel, then a dense expert: the stacks become dense and expert
    0 comes back exactly as the gguf package dequantizes it (its codes and scales are exact)."""
    if not _kernel_runs(_kernel_form(kind)):
        pytest.skip("no kernel to pack expert 0 with (the fallback: test_without_the_kernels_...)")
    with CPU:
        experts = FusedExperts(E, H, I)
    _, planes = _quantized(kind, H, I, np.random.default_rng(0))
    experts.load_quantized(0, "down_proj", planes)
    assert experts.packers["down_proj"].filled == {0}  # packed on the kernel, not held
    experts, gate_up, down = _experts([kind, None, kind])
    assert not experts.packed
    assert experts.fallback_reasons["down_proj"] == "not every expert arrived quantized"
    assert torch.equal(experts.down_proj, down) and torch.equal(experts.gate_up_proj, gate_up)


def _assert_equal_but_packed_scales(experts, gate_up, down, packed_first: list[int]) -> None:
    """The dense stacks equal the reference except the experts `packed_first` (unpacked again:
    bf16 scales), and so does the product, within that rounding."""
    rest = [e for e in range(E) if e not in packed_first]
    assert torch.equal(experts.down_proj[rest], down[rest])
    assert torch.equal(experts.gate_up_proj[rest], gate_up[rest])
    x, ids, weights = _routing(7)
    ref = _per_token(x, gate_up, down, ids, weights)
    tol = 4 * BF16_ULP * ref.abs().max().item()
    torch.testing.assert_close(experts(x, ids, weights), ref, rtol=0, atol=tol)


def test_packed_experts_run_on_the_cpu_and_cuda():
    """int4 planes on both; Q6_K and Q5_K on the CPU only, and Q4_K as int4 planes on CUDA
    (the form ExpertPacker packs on a device)."""
    from kiln.layers.packed import for_device

    cuda = torch.device("cuda")
    _, planes = _quantized("Q4_0", 64, 256, np.random.default_rng(0))
    assert unpackable_reason(planes, CPU) is None
    assert unpackable_reason(planes, cuda) is None
    assert "the CPU and CUDA" in unpackable_reason(planes, torch.device("mps"))
    for kind in ("Q6_K", "Q5_K"):
        _, codes = _quantized(kind, 64, 256, np.random.default_rng(0))
        assert "on the CPU only" in unpackable_reason(codes, cuda)
    _, exact = _quantized("Q4_K", 64, 256, np.random.default_rng(0))
    assert isinstance(for_device(exact, cuda).planes[0], Int4Codes)
    assert unpackable_reason(for_device(exact, cuda), cuda) is None


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K-int4", "Q8_0"])
def test_the_cuda_layout_holds_the_planes(kind):
    """Two codes a byte and bf16 scales per group (the Triton grouped kernel's layout) give
    back the planes' weight, within the scales' bf16 rounding (exact for Q4_0's codes)."""
    ref, planes = _quantized(kind, 64, 256, np.random.default_rng(1))
    back = sum(nibble_dequantize(*nibble_plane(p, CPU), 32) for p in planes.planes)
    torch.testing.assert_close(back, ref, rtol=0, atol=2 * BF16_ULP * ref.abs().max().item())
    codes = planes.planes[0].codes
    pairs, _ = nibble_plane(planes.planes[0], CPU)
    assert torch.equal(pairs & 15, codes[:, 0::2]) and torch.equal(pairs >> 4, codes[:, 1::2])


def _dequantized_hf(hf, kind_of):
    """HF's Qwen3-MoE with every matrix replaced by its GGUF type's (`kind_of(name)`, named as
    tests.gguf_files.write_gguf names them) dequantized values, the experts per expert, as
    the file stores them."""

    def round_trip(w: np.ndarray, name: str) -> torch.Tensor:
        kind = kind_of(name)
        if kind == T.F32:
            return torch.from_numpy(w)
        stacked = w.reshape(-1, w.shape[-1])  # quantized by rows, per expert alike
        back = gguf.quants.dequantize(quantize(stacked, kind), kind).reshape(w.shape)
        return torch.from_numpy(back)

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                gate, up = np.split(p.numpy(), 2, axis=1)
                stem = name.removesuffix("experts.gate_up_proj")
                p.copy_(torch.cat([round_trip(gate.copy(), stem + "stacked_gate"),
                                   round_trip(up.copy(), stem + "stacked_up")], 1))  # fmt: skip
            elif name.endswith("experts.down_proj"):
                stem = name.removesuffix("experts.down_proj")
                p.copy_(round_trip(p.numpy(), stem + "stacked_down"))
            elif p.ndim == 2:
                p.copy_(round_trip(p.numpy(), name))
    return hf


def _engine_matches_hf(path: str, tokenizer: str, hf, tol_ulps: int = 8):
    """kiln's engine on `path` against `hf` (the same values, dequantized): 4 greedy tokens'
    logits within `tol_ulps` bf16 ulps of the largest, and the same tokens."""
    from kiln import SamplingParams
    from tests.helpers import make_engine, run_schedule

    engine = make_engine(path, tokenizer=tokenizer)
    prompt = [5, 17, 300, 4000, 12, 9, 77, 1024]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out, logits = run_schedule(engine, [(0, prompt, params)], record_logits=True)
    ours, tokens = torch.stack(logits["0"]).float(), out["0"].outputs[0].token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    bound = tol_ulps * BF16_ULP * ref.abs().max().item()
    torch.testing.assert_close(ours, ref, rtol=0, atol=bound)
    assert tokens == ref.argmax(-1).tolist()
    return engine


def test_a_packed_moe_gguf_matches_hf_on_the_dequantized_weights(tiny_models, packed_moe_gguf):
    """The tiny Qwen3-MoE as a qwen3moe GGUF (experts Q4_1 and Q8_0, attention Q4_0, router,
    dense MLP, embedding and head Q8_0): kiln keeps every matrix packed and matches HF on the
    same values dequantized, to a few bf16 ulps of the logits (1.5 measured, 8 allowed, as for
    test_packed.py's Llama)."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3_moe"]).eval()
    hf = _dequantized_hf(hf, packed_moe_kind)
    engine = _engine_matches_hf(packed_moe_gguf, tiny_models["qwen3_moe"], hf)
    model = engine.runner.model
    assert set(model.layers[0].mlp.experts.packed) == {"gate_up_proj", "down_proj"}
    formats = [fmt for fmt, _, _ in model.weight_summary]
    assert "experts: Q4_1 -> int4 packed, group 32" in formats
    assert "experts: Q8_0 -> int4 packed, group 32 (two planes)" in formats


def test_a_k_quant_moe_gguf_matches_hf_on_the_dequantized_weights(
    tiny_models, k_quant_moe_gguf, kernels
):
    """A Q4_K_M/Q5_K_M-like Qwen3-MoE (tests.conftest.K_QUANT_MOE: Q4_K gate/up beside Q6_K
    down experts, Q5_K gate/up beside Q4_K down): every expert stack packed on this CPU's
    kernels (without them: Q4_K as int4 planes, Q6_K and Q5_K dense), and the logits as HF's
    on the same values dequantized (the codes are exact and the rows go in as two int8 planes:
    measured 0.01 bf16 ulps of the largest logit; without the kernels the int4 planes' bf16
    scales give 1.04; 8 allowed, as for the other packed models)."""
    from tests.conftest import k_quant_moe_model

    hf = _dequantized_hf(k_quant_moe_model(), k_quant_moe_kind)
    engine = _engine_matches_hf(k_quant_moe_gguf, tiny_models["qwen3_moe"], hf)
    layers = engine.runner.model.layers
    experts = [layer.mlp.experts for layer in layers]
    forms = [[e.packed[s].form if s in e.packed else None for s in ("gate_up_proj", "down_proj")]
             for e in experts]  # fmt: skip
    if not kernels:
        assert forms == [[32, None], [None, 32]]
        return
    assert forms == [[KQUANT_FORM, Q6K_FORM], [KQUANT_FORM, KQUANT_FORM]]
    formats = {fmt for fmt, _, _ in engine.runner.model.weight_summary}
    assert {f"experts: Q{b}_K -> {b}-bit packed (Q{b}_K's layout)" for b in (4, 5, 6)} <= formats


def test_the_benchmarks_random_moe_file_loads_packed(tmp_path, monkeypatch):
    """benchmarks/make_random_gguf.py's mixture-of-experts shape, shrunk: llama.cpp's qwen3moe
    layout (router, stacked experts) that kiln reads as its config says and keeps packed."""
    from benchmarks import make_random_gguf
    from kiln import LLM, SamplingParams

    small = dict(make_random_gguf.SHAPES["qwen3-30b-a3b-4-layers"], layers=2, hidden=256,
                 heads=4, kv_heads=2, head_dim=64, vocab=49152, experts=8, top_k=2,
                 expert_intermediate=64, context=512)  # fmt: skip
    monkeypatch.setitem(make_random_gguf.SHAPES, "small-moe", small)
    path = str(tmp_path / "moe.gguf")
    make_random_gguf.write("small-moe", "Q4_0", path)
    llm = LLM(path, kv_cache_memory="16MiB", compilation_config={"mode": 0})
    config = llm.engine.runner.model.config
    assert (config.moe.num_experts, config.moe.top_k, config.sparse_layers) == (8, 2, (0, 1))
    experts = llm.engine.runner.model.layers[1].mlp.experts
    assert set(experts.packed) == {"gate_up_proj", "down_proj"}
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_packed_experts_take_the_rows_as_int8_planes():
    """--packed-activations reaches the experts: two int8 planes (16 bits of each value) move
    the output, by far less than a bf16 rounding of it; float rows are the module's default."""
    from kiln.layers.int4_kernel import int4_matmul_kernel

    kernel = int4_matmul_kernel()
    if kernel is None or not kernel.has_int8_rows:
        pytest.skip("kiln's int4 kernel has no int8 path here (AVX512-VNNI with VBMI, or AVX2)")
    experts, _, _ = _experts(["Q4_0"] * E)
    x, ids, weights = _routing(5)
    floats = experts(x, ids, weights)
    for module in experts.packed.values():
        module.int8_planes = 2
    planes = experts(x, ids, weights)
    assert not torch.equal(planes, floats)
    # measured: 1.1e-4 of the output's magnitude, two products deep; a bf16 rounding is 3.9e-3
    tol = BF16_ULP / 4 * floats.abs().max().item()
    torch.testing.assert_close(planes, floats, rtol=0, atol=tol)


def test_the_moe_benchmark_checks_its_packed_blocks():
    """benchmarks/moe_block.py's smoke run: each packed block (Q4_0 experts; Q4_K gate/up
    beside Q6_K down where this CPU runs their kernels) is checked against the same weights
    dequantized before it is timed, with the others against HF."""
    from tests.helpers import load_benchmark

    kernels = _kernel_runs(Q6K_FORM) and _kernel_runs(KQUANT_FORM)
    packed = ["Q4_0", "Q4_K_M"] if kernels else ["Q4_0"]
    args = ["--hidden", "256", "--intermediate", "256", "--experts", "4", "--top-k", "2",
            "--tokens", "1", "5", "--rounds", "1", "--device", "cpu"]  # fmt: skip
    args += ["--packed", *packed]
    rows = load_benchmark("moe_block").main(args)
    assert [r["tokens"] for r in rows] == [1, 5]
    assert all(r[f"kiln (packed {kind})"] > 0 for r in rows for kind in packed)
