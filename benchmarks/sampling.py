"""The sampler alone: one step's `sample` (penalties, filters, the draw) over a batch of rows
of the embedded model's vocabulary, per sampling setting and row count, median ms a step.
Logits are random normals: a flat distribution, the worst case for top-p's partial sort (a
model's peaked logits usually end the nucleus among the first candidates).

    python benchmarks/sampling.py
    python benchmarks/sampling.py --rows 1 16 64 --vocab 151936      # Qwen3's vocabulary"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from kiln import SamplingParams
from kiln.runner.sampler import SamplingBatch, sample

SETTINGS = {
    "greedy": SamplingParams(temperature=0),
    "temperature 1": SamplingParams(temperature=1.0),
    "top-k 50": SamplingParams(temperature=0.7, top_k=50),
    "top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
}


def step_ms(params: SamplingParams, rows: int, vocab: int, repeats: int) -> float:
    seqs = [
        SimpleNamespace(params=params, token_ids=[1, 2], num_prompt_tokens=1,
                        num_output_tokens=1, generator=None)
        for _ in range(rows)
    ]  # fmt: skip
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        sample(logits, SamplingBatch.build(seqs, vocab, logits.device), frozenset(), gen)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print("| setting | " + " | ".join(f"{r} rows" for r in args.rows) + " |")
    print("| --- |" + " --- |" * len(args.rows))
    for name, params in SETTINGS.items():
        cells = [f"{step_ms(params, r, args.vocab, args.repeats):.2f}" for r in args.rows]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
