"""A GGUF's decode with every packable type kept packed against the same file with some types
dequantized at load (as kiln did before it packed them), two engines in one process, rounds
alternating.

    python benchmarks/make_random_gguf.py --shape llama-3.2-1b --type Q4_K_M --out /tmp/km.gguf
    python benchmarks/packed_types_ab.py --model /tmp/km.gguf --dequantize Q6_K --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

from kiln import LLM, SamplingParams
from kiln.loader import gguf as gguf_loader
from kiln.loader.gguf_quant import PACKED_GGUF_TYPES

PROMPT = "Write a long story about a lighthouse keeper and her cat."


def boot(model: str, dtype: str, mode: int, dequantize: list[str]) -> LLM:
    """An engine whose loader packs every type but `dequantize`."""
    packed = tuple(t for t in PACKED_GGUF_TYPES if t not in dequantize)
    with mock.patch.object(gguf_loader, "PACKED_GGUF_TYPES", packed):
        return LLM(model, dtype=dtype, compilation_config={"mode": mode})


def decode_seconds(llm: LLM, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([PROMPT], params)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dequantize", nargs="+", default=["Q6_K"], choices=PACKED_GGUF_TYPES)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--mode", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    engines = {"packed": boot(args.model, args.dtype, args.mode, []),
               "dequantized": boot(args.model, args.dtype, args.mode, args.dequantize)}  # fmt: skip
    for name, llm in engines.items():
        weights = sum(b for _, _, b in llm.engine.runner.model.weight_summary) / 2**20
        print(f"{name}: resident weights {weights:.0f} MiB")
        decode_seconds(llm, 8)  # warm
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in engines if r % 2 == 0 else list(engines)[::-1]:
            seconds[name].append(decode_seconds(engines[name], args.tokens))
            print(f"round {r + 1} {name}: {args.tokens / seconds[name][-1]:.2f} tok/s")
    rate = {k: args.tokens / statistics.median(v) for k, v in seconds.items()}
    print(f"median tok/s: packed {rate['packed']:.2f}, {'+'.join(args.dequantize)} dequantized "
          f"{rate['dequantized']:.2f}, packed / dequantized "
          f"{rate['packed'] / rate['dequantized']:.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
