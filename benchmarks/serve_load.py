"""Load on a running kiln server (or any OpenAI-compatible one): throughput and TTFT / ITL
percentiles at several concurrency levels, in one run.

    kiln serve &                                    # or --base-url of another server
    python benchmarks/serve_load.py --concurrency 1 4 16 64 --requests 64

Each request streams a completion of a fixed length (ignore_eos) from a distinct prompt, so no
two share a prefix. TTFT is measured to the first chunk that carries text; ITL between chunks.
`--temperature` (default 0, greedy) samples instead."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time

import openai


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


async def one(client, model: str, i: int, max_tokens: int, temperature: float = 0.0) -> dict:
    t0 = time.perf_counter()
    stamps = []
    stream = await client.completions.create(
        model=model,
        prompt=f"Request {i}: write a long story about a lighthouse keeper.",
        max_tokens=max_tokens,
        temperature=temperature,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    return {
        "ttft": stamps[0] - t0,
        "itl": [b - a for a, b in itertools.pairwise(stamps)],
        "tokens": max_tokens,
        "end": stamps[-1],
    }


async def level(
    client, model: str, concurrency: int, requests: int, max_tokens: int, temperature: float = 0.0
) -> dict:
    sem = asyncio.Semaphore(concurrency)

    async def guarded(i: int) -> dict:
        async with sem:
            return await one(client, model, i, max_tokens, temperature)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(guarded(i) for i in range(requests)))
    wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    return {
        "concurrency": concurrency,
        "requests": requests,
        "output_tok_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50": pct(ttft, 50),
        "ttft_p90": pct(ttft, 90),
        "ttft_p99": pct(ttft, 99),
        "itl_p50": pct(itl, 50),
        "itl_p90": pct(itl, 90),
        "itl_p99": pct(itl, 99),
        "itl_mean": statistics.fmean(itl) if itl else float("nan"),
    }


async def main_async(args) -> list[dict]:
    client = openai.AsyncOpenAI(
        base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=600
    )
    model = args.model or (await client.models.list()).data[0].id
    await one(client, model, -1, 4)  # warm-up
    rows = []
    for c in args.concurrency:
        rows.append(
            await level(client, model, c, max(c, args.requests), args.max_tokens, args.temperature)
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--model")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument(
        "--requests", type=int, default=16, help="per level (at least its concurrency)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; clients often send 0.7-1"
    )
    parser.add_argument("--output")
    args = parser.parse_args()
    rows = asyncio.run(main_async(args))
    print("| concurrency | requests | output tok/s | TTFT p50/p90/p99 s | ITL p50/p90/p99 ms |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['concurrency']} | {r['requests']} | {r['output_tok_s']:.1f} | "
            f"{r['ttft_p50']:.2f} / {r['ttft_p90']:.2f} / {r['ttft_p99']:.2f} | "
            f"{r['itl_p50'] * 1e3:.0f} / {r['itl_p90'] * 1e3:.0f} / {r['itl_p99'] * 1e3:.0f} |"
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
