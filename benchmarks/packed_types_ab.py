"""A GGUF's decode with every packable type kept packed against the same file with some types
dequantized at load (as kiln did before it packed them), two engines in one process, rounds
alternating.

    python benchmarks/make_random_gguf.py --shape llama-3.2-1b --type Q4_K_M --out /tmp/km.gguf
    python benchmarks/packed_types_ab.py --model /tmp/km.gguf --dequantize Q6_K --rounds 4
    python benchmarks/packed_types_ab.py --model /tmp/km.gguf --dequantize-mixed --rounds 4

`--dequantize-mixed`: the second engine packs every type but dequantizes fused layers whose
parts mix formats (a Q4_K_M file's qkv with a Q6_K v), as kiln did before PackedParts.
`--q4-k-int4`: the second engine keeps Q4_K as int4 planes on the int4 kernel, as kiln did
before Q4_K ran on the K-quant kernel. `--experts-int4-only`: the second engine keeps a
mixture-of-experts file's experts as kiln did before they ran on the Q6_K and K-quant kernels:
Q4_K experts as int4 planes, Q6_K and Q5_K experts dequantized.

    python benchmarks/packed_types_ab.py --model /tmp/km.gguf --q4-k-int4 --rounds 6 --mode 3
    python benchmarks/make_random_gguf.py --shape qwen3-30b-a3b-4-layers --type Q4_K_M \
        --out /tmp/moe-km.gguf
    python benchmarks/packed_types_ab.py --model /tmp/moe-km.gguf --experts-int4-only

`--avx2`: both engines run kiln's kernels as a CPU with AVX2 and FMA but no AVX-512 builds them
(`-mavx2 -mfma` for `-march=native`); with PyTorch's and oneDNN's kernels limited the same way
by their environment variables, the process stands in for such a CPU. Before the Q6_K and
K-quant kernels had AVX2 paths, that CPU dequantized Q6_K and kept Q4_K as int4 planes:

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/packed_types_ab.py \
        --model /tmp/km.gguf --avx2 --dequantize Q6_K --q4-k-int4 --rounds 4
"""

from __future__ import annotations

import argparse
from unittest import mock

from int4_table_ab import alternating_rounds, decode_seconds, report_rate  # beside this script

from kiln import LLM, native
from kiln.attention import cpu_kernel
from kiln.layers import (
    bf16_kernel,
    int4_kernel,
    kquant_kernel,
    linear,
    packed_experts,
    packed_parts,
    q6k_kernel,
)
from kiln.layers.packed import as_int4_plane
from kiln.loader import gguf as gguf_loader
from kiln.loader.gguf_quant import PACKED_GGUF_TYPES


def boot(
    model: str, dtype: str, mode: int, dequantize: list[str], mixed: bool = True,
    q4_k_int4: bool = False, experts_int4_only: bool = False,
) -> LLM:  # fmt: skip
    """An engine whose loader packs every type but `dequantize` (without `mixed`, no fused
    layer of mixed formats; with `q4_k_int4`, Q4_K as int4 planes; with `experts_int4_only`,
    experts as int4 planes or dense)."""
    packed = tuple(t for t in PACKED_GGUF_TYPES if t not in dequantize)
    pack = packed_parts.pack_parts if mixed else _one_format_only
    as_int4 = lambda t, device: as_int4_plane(t)  # noqa: E731
    form = as_int4 if q4_k_int4 else packed_parts.for_device
    expert_form = as_int4 if q4_k_int4 or experts_int4_only else packed_experts.for_device
    reason = _int4_experts_only if experts_int4_only else packed_experts.unpackable_reason
    with mock.patch.object(gguf_loader, "PACKED_GGUF_TYPES", packed), \
            mock.patch.object(linear, "pack_parts", pack), \
            mock.patch.object(packed_parts, "for_device", form), \
            mock.patch.object(packed_experts, "for_device", expert_form), \
            mock.patch.object(packed_experts, "unpackable_reason", reason):  # fmt: skip
        return LLM(model, dtype=dtype, compilation_config={"mode": mode})


def build_kernels_for_avx2() -> None:
    """Every kiln kernel of this process built as for a CPU with AVX2 and FMA only."""
    for module in (int4_kernel, q6k_kernel, kquant_kernel, bf16_kernel, cpu_kernel):
        module.FLAGS = native.AVX2_FLAGS


def _int4_experts_only(t, device):
    if packed_experts.form_of(t) in packed_experts.KERNEL_LAYOUTS:
        return f"{t.kind} experts dequantized (--experts-int4-only)"
    return _EXPERTS_REASON(t, device)


# the unpatched reason, taken at import: boot() patches the module's name while it loads
_EXPERTS_REASON = packed_experts.unpackable_reason


def _one_format_only(parts, out_features, device):
    if len(packed_parts._runs_of_one_format(parts)) > 1:
        return None, "its parts mix formats (--dequantize-mixed)"
    return packed_parts.pack_parts(parts, out_features, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dequantize", nargs="+", default=[], choices=PACKED_GGUF_TYPES)
    parser.add_argument("--dequantize-mixed", action="store_true")
    parser.add_argument("--q4-k-int4", action="store_true")
    parser.add_argument("--experts-int4-only", action="store_true")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--mode", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--avx2", action="store_true", help="kiln's kernels built for AVX2")
    args = parser.parse_args()
    if args.avx2:
        build_kernels_for_avx2()
    if not (args.dequantize or args.dequantize_mixed or args.q4_k_int4 or args.experts_int4_only):
        parser.error("name types to --dequantize, or --dequantize-mixed, --q4-k-int4 or "
                     "--experts-int4-only")  # fmt: skip
    other = boot(args.model, args.dtype, args.mode, args.dequantize, not args.dequantize_mixed,
                 args.q4_k_int4, args.experts_int4_only)  # fmt: skip
    engines = {"packed": boot(args.model, args.dtype, args.mode, []), "dequantized": other}
    for name, llm in engines.items():
        weights = sum(b for _, _, b in llm.engine.runner.model.weight_summary) / 2**20
        print(f"{name}: resident weights {weights:.0f} MiB")
        decode_seconds(llm, 8)  # warm
    runs = {name: lambda llm=llm: decode_seconds(llm, args.tokens) for name, llm in engines.items()}
    median = alternating_rounds(runs, args.rounds, report_rate(args.tokens))
    rate = {k: args.tokens / v for k, v in median.items()}
    what = "+".join(args.dequantize + (["mixed layers"] if args.dequantize_mixed else []))
    other_name = "Q4_K as int4 planes" if args.q4_k_int4 else f"{what} dequantized"
    other_name = "experts int4 or dense" if args.experts_int4_only else other_name
    print(f"median tok/s: packed {rate['packed']:.2f}, {other_name} {rate['dequantized']:.2f}, "
          f"packed / other {rate['packed'] / rate['dequantized']:.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
