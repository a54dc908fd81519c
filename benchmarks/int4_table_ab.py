"""A packed model's decode with its zero-free tables as the scales alone against the same tables
widened back to (scale, zero) pairs, in one process on one engine.

On the CPU a packed plane whose zeros are all 0 (GGUF's Q4_0, symmetric GPTQ and AutoRound,
Q8_0's high plane) keeps a [K/G, N, 1] table: 4.5 bits a weight for a one-row step to read where
the pairs make 5. kiln's kernel reads both widths, so this script boots one engine (eager, mode
0: the compiled graphs would recompile on the widened buffers) and alternates rounds of greedy
decode with the tables as loaded and widened in place, rotating the order each round.

    python benchmarks/make_random_gguf.py --shape llama-3.2-1b --type Q4_0 --out /tmp/l1b.gguf
    python benchmarks/int4_table_ab.py --model /tmp/l1b.gguf --dtype bfloat16 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kiln import LLM, SamplingParams
from kiln.layers.cpu_int4_layout import pairs_table
from kiln.layers.packed import PackedInt4

PROMPT = "Write a long story about a lighthouse keeper and her cat."


def scale_only_buffers(model: torch.nn.Module) -> list[tuple[PackedInt4, str, torch.Tensor]]:
    """(module, buffer name, the [K/G, N, 1] table) of every scales-only table."""
    found = []
    for module in model.modules():
        if isinstance(module, PackedInt4):
            for i in range(module.num_planes):
                table = getattr(module, f"scales_zeros{i}")
                if table.shape[-1] == 1:
                    found.append((module, f"scales_zeros{i}", table))
    return found


def set_layout(tables: list[tuple[PackedInt4, str, torch.Tensor]], layout: str) -> None:
    for module, name, table in tables:
        setattr(module, name, table if layout == "scales" else pairs_table(table))


def decode_seconds(llm: LLM, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([PROMPT], params)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a packed model (default: the embedded model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, compilation_config={"mode": 0})
    tables = scale_only_buffers(llm.engine.runner.model)
    if not tables:
        raise SystemExit("this model has no scales-only tables (no plane whose zeros are all 0)")
    print(f"{len(tables)} scales-only tables")
    decode_seconds(llm, 8)  # warm
    seconds: dict[str, list[float]] = {"scales": [], "pairs": []}
    for r in range(args.rounds):
        for layout in ("scales", "pairs") if r % 2 == 0 else ("pairs", "scales"):
            set_layout(tables, layout)
            seconds[layout].append(decode_seconds(llm, args.tokens))
            print(f"round {r + 1} {layout}: {args.tokens / seconds[layout][-1]:.2f} tok/s")
    rate = {k: args.tokens / statistics.median(v) for k, v in seconds.items()}
    print(f"median tok/s: scales alone {rate['scales']:.2f}, pairs {rate['pairs']:.2f}, "
          f"scales / pairs {rate['scales'] / rate['pairs']:.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
