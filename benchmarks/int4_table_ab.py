"""A packed model's decode with its zero-free tables as the scales alone against the same tables
widened back to (scale, zero) pairs, in one process on one engine.

On the CPU a packed plane whose zeros are all 0 (GGUF's Q4_0, symmetric GPTQ and AutoRound,
Q8_0's high plane) keeps a [K/G, N, 1] table: 4.5 bits a weight for a one-row step to read where
the pairs make 5. kiln's kernel reads both widths, so this script boots one engine (eager, mode
0: the compiled graphs would recompile on the widened buffers) and alternates rounds of greedy
decode with the tables as loaded and widened in place, rotating the order each round.
`--kernel` times kiln's kernel alone instead: one row through every matrix of a
Llama-3.2-1B-shaped model (random codes, 772 MB with pairs), from memory, per rows' form.

    python benchmarks/make_random_gguf.py --shape llama-3.2-1b --type Q4_0 --out /tmp/l1b.gguf
    python benchmarks/int4_table_ab.py --model /tmp/l1b.gguf --dtype bfloat16 --rounds 4
    python benchmarks/int4_table_ab.py --kernel --rounds 6
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kiln import LLM, SamplingParams
from kiln.layers.cpu_int4_layout import pairs_table
from kiln.layers.packed import PackedInt4

PROMPT = "Write a long story about a lighthouse keeper and her cat."
# Llama-3.2-1B's matrices, [N, K]: per layer q, k, v, o, gate, up, down; then the tied head
L1B_SHAPES = [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048),
              (2048, 8192)] * 16 + [(128256, 2048)]  # fmt: skip


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
    return _timed(lambda: llm.generate([PROMPT], params))


def report_rate(tokens: int) -> Callable[[int, str, float], None]:
    """alternating_rounds' report for decode rounds of `tokens` tokens."""
    return lambda r, name, seconds: print(f"round {r} {name}: {tokens / seconds:.2f} tok/s")


def alternating_rounds(
    runs: dict[str, Callable[[], float]], rounds: int, report: Callable[[int, str, float], None]
) -> dict[str, float]:
    """Each run's seconds over `rounds` rounds, the order reversed every other round (this
    machine drifts within minutes); `report(round, name, seconds)` after each. Medians."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in runs if r % 2 == 0 else list(runs)[::-1]:
            seconds[name].append(runs[name]())
            report(r + 1, name, seconds[name][-1])
    return {name: statistics.median(v) for name, v in seconds.items()}


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def kernel_rounds(rounds: int) -> None:
    """kiln's kernel alone: one row through every 1B matrix, per table width and rows' form."""
    from kiln.layers.cpu_int4_layout import cpu_block_n
    from kiln.layers.int4_kernel import int4_matmul_kernel

    kernel, block = int4_matmul_kernel(), cpu_block_n()
    if kernel is None or block is None:
        raise SystemExit("kiln's int4 kernel is not built on this machine")
    g = torch.Generator().manual_seed(0)
    pairs = []
    for n, k in L1B_SHAPES:
        table = (torch.rand(k // 32, n, 2, generator=g) * 0.01).to(torch.bfloat16)
        table[..., 1] = 0
        pairs.append((torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), table))
    weights = {"scales": [(p, t[..., :1].contiguous()) for p, t in pairs], "pairs": pairs}
    rows = {k: torch.randn(1, k, generator=g) for k in (2048, 8192)}

    def step(layout: str, planes: int) -> None:
        for packed, table in weights[layout]:
            kernel.matmul(rows[packed.shape[1] * 2], packed, table, 32, block, int8_planes=planes)

    for planes in (2, 1, 0) if kernel.has_int8_rows else (0,):
        runs = {k: lambda k=k, p=planes: _timed(lambda: step(k, p)) for k in ("scales", "pairs")}
        median = alternating_rounds(runs, rounds, lambda *_: None)
        ms = {k: v * 1e3 for k, v in median.items()}
        ratio = ms["pairs"] / ms["scales"]
        print(
            f"int8 planes {planes}: one row through every matrix: scales alone "
            f"{ms['scales']:.1f} ms, pairs {ms['pairs']:.1f} ms, pairs / scales {ratio:.3f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a packed model (default: the embedded model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--kernel", action="store_true", help="the kernel alone, 1B shapes")
    args = parser.parse_args()
    if args.kernel:
        return kernel_rounds(args.rounds)
    llm = LLM(args.model, dtype=args.dtype, compilation_config={"mode": 0})
    tables = scale_only_buffers(llm.engine.runner.model)
    if not tables:
        raise SystemExit("this model has no scales-only tables (no plane whose zeros are all 0)")
    print(f"{len(tables)} scales-only tables")
    decode_seconds(llm, 8)  # warm

    def decode_as(layout: str) -> float:
        set_layout(tables, layout)
        return decode_seconds(llm, args.tokens)

    runs = {k: lambda k=k: decode_as(k) for k in ("scales", "pairs")}
    median = alternating_rounds(runs, args.rounds, report_rate(args.tokens))
    rate = {k: args.tokens / v for k, v in median.items()}
    print(f"median tok/s: scales alone {rate['scales']:.2f}, pairs {rate['pairs']:.2f}, "
          f"scales / pairs {rate['scales'] / rate['pairs']:.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
