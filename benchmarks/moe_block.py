"""The mixture-of-experts block alone: kiln's SparseMoE (its CPU product, one matmul pair per
active expert, and the grouped product CUDA graphs capture) against HF transformers' own
Qwen3-MoE block on the same weights, in one run, interleaved, medians of each. Shapes are
Qwen3-30B-A3B's expert mix (128 experts, top 8) scaled to a small machine by default.

With `--packed TYPE ...` (`--int4`: Q4_0), a block per GGUF type whose experts are kept packed
joins: the HF weights quantized to that type (Q4_0 by the `gguf` package; Q4_K, Q5_K and Q6_K as
random blocks of the type, as benchmarks/make_random_gguf.py writes them), on kiln's CPU kernels
(int4 planes, or the Q6_K and K-quant kernels) or the grouped int4 Triton kernel on CUDA (Q4_0
and Q4_K only: Q5_K, Q6_K and Q4_K_M stay packed on the CPU only). Q4_K_M
is Q4_K gate/up beside Q6_K down experts (a Q4_K_M file's more-bits layers); Q4_K-int4 is Q4_K
as int4 planes (where the K-quant kernel does not run). Each packed block is checked against
kiln's per-expert block on its weights dequantized, and timed beside HF's and the dense ones;
on the CPU its rows go into the kernels as `--packed-activations auto` puts them.

    python benchmarks/moe_block.py                                # CPU, fp32
    python benchmarks/moe_block.py --hidden 2048 --intermediate 768 --experts 128 \
        --dtype bfloat16 --packed Q4_K_M Q4_K-int4 Q6_K"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from kiln.layers import moe


def _hf_block(args: argparse.Namespace) -> torch.nn.Module:
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=args.hidden, num_experts=args.experts, num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.intermediate, norm_topk_prob=True,
    )  # fmt: skip
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block


def _kiln_block(hf: torch.nn.Module, args: argparse.Namespace, product) -> torch.nn.Module:
    block = moe.SparseMoE(args.hidden, args.experts, args.top_k, args.intermediate, True, 0)
    with torch.no_grad():
        block.gate.weight.copy_(hf.gate.weight)
        block.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        block.experts.down_proj.copy_(hf.experts.down_proj)
    block.experts.forward = lambda x, ids, w: product(  # which product, bypassing the op
        x, block.experts.gate_up_proj, block.experts.down_proj, ids, w
    )
    return block


# a packed block's types: (gate and up, down); "-int4": read as int4 planes
PACKED_TYPES = {"Q4_0": ("Q4_0", "Q4_0"), "Q4_K": ("Q4_K", "Q4_K"), "Q5_K": ("Q5_K", "Q5_K"),
                "Q6_K": ("Q6_K", "Q6_K"), "Q4_K_M": ("Q4_K", "Q6_K"),
                "Q4_K-int4": ("Q4_K-int4", "Q4_K-int4")}  # fmt: skip


def _blocks_of(kind: str, w: torch.Tensor):
    """(GGUF blocks, their type's name) of `w`: Q4_0 quantized from it, the K-quants random
    blocks of its shape (make_random_gguf's, std near 0.02)."""
    import gguf

    base = kind.removesuffix("-int4")
    if base == "Q4_0":
        return gguf.quants.quantize(w.float().cpu().numpy(), gguf.GGMLQuantizationType.Q4_0), base
    rng = np.random.default_rng(w.shape[0] * 7919 + w.shape[1])
    return _sibling("make_random_gguf").MAKERS[base](rng, *w.shape), base


def _sibling(name: str) -> ModuleType:
    """Another script of benchmarks/ (not a package), wherever this one is run from."""
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _packed_block(hf: torch.nn.Module, args, device, dtype, kind: str):
    """kiln's block with experts of GGUF type `kind` (PACKED_TYPES) kept packed, and the
    per-expert block on those weights dequantized (its reference)."""
    import gguf

    from kiln.boot.cpu_linears import choose_packed_activations
    from kiln.loader.gguf_quant import gguf_codes
    from kiln.models import build_on

    block = build_on(device, dtype, lambda: moe.SparseMoE(
        args.hidden, args.experts, args.top_k, args.intermediate, True, 0))  # fmt: skip
    dense = _kiln_block(hf, args, moe.experts_by_loop).to(device, dtype)
    inter, (gate_up_kind, down_kind) = args.intermediate, PACKED_TYPES[kind]
    with torch.no_grad():
        block.gate.weight.copy_(hf.gate.weight)
        for e in range(args.experts):
            gate_up, down = dense.experts.gate_up_proj[e], dense.experts.down_proj[e]
            for proj, w, of in (("gate_proj", gate_up[:inter], gate_up_kind),
                                ("up_proj", gate_up[inter:], gate_up_kind),
                                ("down_proj", down, down_kind)):  # fmt: skip
                data, base = _blocks_of(of, w)
                codes = gguf_codes(base, data, tuple(w.shape), exact_q4_k=of == "Q4_K")
                block.experts.load_quantized(e, proj, codes)
                t = gguf.GGMLQuantizationType[base]
                w.copy_(torch.from_numpy(gguf.quants.dequantize(data, t)))
    block.experts.finalize(device)
    if set(block.experts.packed) != {"gate_up_proj", "down_proj"}:
        raise SystemExit(f"the experts were not kept packed: {block.experts.fallback_reasons}")
    if device.type == "cpu":  # the rows as the engine's default puts them into the kernels
        choose_packed_activations(block, "auto", strict=False)
    return block, dense


def _time(fn, x: torch.Tensor, repeats: int) -> float:
    fn(x)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(x)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def _check(blocks: dict, references: dict, hf, x: torch.Tensor) -> None:
    """Each kiln block against HF's, each packed one against its weights dequantized (bf16
    scales or int8 rows: a few bf16 ulps)."""
    ref = hf(x[None])[0]
    for name, block in blocks.items():
        if name in references:
            want = references[name](x)
            atol = 16 * 2**-8 * want.abs().max().item()
            torch.testing.assert_close(block(x), want, rtol=0, atol=atol)
        elif name != "hf":
            torch.testing.assert_close(block(x), ref, rtol=2e-2, atol=2e-3)


def _medians(blocks: dict, hf, x: torch.Tensor, rounds: int) -> dict[str, float]:
    """Each block's median ms, rounds interleaved, the order rotated each round."""
    repeats = max(2, 64 // x.shape[0])
    times = {name: [] for name in blocks}
    for r in range(rounds):
        names = list(blocks)[r % len(blocks) :] + list(blocks)[: r % len(blocks)]
        for name in names:
            fn = (lambda v: hf(v[None])) if name == "hf" else blocks[name]
            times[name].append(_time(fn, x, repeats))
    return {name: statistics.median(t) for name, t in times.items()}


CPU_ONLY_TYPES = ("Q5_K", "Q6_K", "Q4_K_M")  # kiln's Q6_K and K-quant kernels run on the CPU


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--packed", nargs="+", default=[], choices=list(PACKED_TYPES),
                   help="blocks whose experts are kept packed in these GGUF types")  # fmt: skip
    p.add_argument("--int4", action="store_true", help="the same as --packed Q4_0")
    args = p.parse_args(argv)
    args.packed += ["Q4_0"] if args.int4 and "Q4_0" not in args.packed else []
    cpu_only = [kind for kind in args.packed if kind in CPU_ONLY_TYPES]
    if cpu_only and args.device != "cpu":
        p.error(f"--packed {' '.join(cpu_only)}: those experts stay packed on the CPU only "
                "(on CUDA they are dequantized); use --device cpu")  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = _arguments(argv)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    torch.manual_seed(0)
    hf = _hf_block(args).to(device, dtype).eval()
    blocks = {
        "hf": hf,
        "kiln (per-expert)": _kiln_block(hf, args, moe.experts_by_loop).to(device, dtype),
        "kiln (grouped)": _kiln_block(hf, args, moe.experts_grouped).to(device, dtype),
    }
    if device.type == "cuda":  # kiln's Triton kernel: what CUDA graphs use where _grouped_mm can't
        blocks["kiln (triton)"] = _kiln_block(hf, args, moe.experts_by_triton).to(device, dtype)
    references = {}
    for kind in args.packed:
        name = f"kiln (packed {kind})"
        blocks[name], references[name] = _packed_block(hf, args, device, dtype, kind)
    rows = []
    with torch.inference_mode():
        for n in args.tokens:
            x = torch.randn(n, args.hidden, device=device, dtype=dtype)
            _check(blocks, references, hf, x)
            med = _medians(blocks, hf, x, args.rounds)
            rows.append({"tokens": n, **{k: round(v, 3) for k, v in med.items()}})
    names = list(blocks)
    print("| tokens | " + " | ".join(f"{n} ms" for n in names) + " | hf / kiln (per-expert) |")
    print("| --- " * (len(names) + 2) + "|")
    for r in rows:
        ratio = r["hf"] / r["kiln (per-expert)"]
        print(f"| {r['tokens']} | " + " | ".join(str(r[n]) for n in names) + f" | {ratio:.2f}x |")
    print(json.dumps({"args": vars(args), "rows": rows}))
    return rows


if __name__ == "__main__":
    main()
