"""The step's token budget (`--max-num-batched-tokens`, the prefill chunk) side by side in one
run: prefill throughput of one long prompt with the longest step (how long every running decode
would stall), and 8 concurrent prompts with output throughput and TTFT.

    python benchmarks/prefill_chunks.py                   # embedded model, budgets 256..2048
    python benchmarks/prefill_chunks.py --model DIR --dtype bfloat16 --mode 3 --budgets 256 512"""

from __future__ import annotations

import argparse
import time

from kiln import LLM, SamplingParams


def long_prompt(llm: LLM, length: int) -> tuple[float, float]:
    """(prefill tok/s, longest step s) for one prompt of `length` tokens."""
    prompt = [(7 * j) % 40000 + 5 for j in range(length)]
    engine = llm.engine
    engine.add_request("long", prompt, SamplingParams(max_tokens=1))
    steps, t0 = [], time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    return length / (time.perf_counter() - t0), max(steps)


def concurrent(llm: LLM, n: int, length: int, out: int) -> tuple[float, float, float]:
    """(output tok/s, min TTFT, max TTFT) for n prompts arriving together."""
    prompts = [
        {"prompt_token_ids": [(7 * j + 13 * i) % 40000 + 5 for j in range(length)]}
        for i in range(n)
    ]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=out, ignore_eos=True))
    ttft = [o.outputs[0].metrics.time_to_first_token for o in outs]
    return n * out / (time.perf_counter() - t0), min(ttft), max(ttft)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a path (default: the embedded model)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--long", type=int, default=4096, help="long prompt length")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024, help="concurrent prompt length")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--mode", type=int, default=0, help="compilation mode (0 or 3)")
    args = parser.parse_args()
    head = [
        "budget",
        "long prompt tok/s",
        "longest step s",
        "concurrent out tok/s",
        "TTFT min / max s",
    ]
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for budget in args.budgets:
        llm = LLM(
            args.model,
            max_model_len=2 * args.long,
            max_num_seqs=args.concurrency,
            max_num_batched_tokens=budget,
            kv_cache_memory="1GiB",
            dtype=args.dtype,
            compilation_config={"mode": args.mode},
        )
        llm.generate({"prompt_token_ids": [5] * 40}, SamplingParams(max_tokens=1))  # warm-up
        rate, stall = long_prompt(llm, args.long)
        out, first, last = concurrent(llm, args.concurrency, args.prompt, args.output_tokens)
        print(f"| {budget} | {rate:.0f} | {stall:.2f} | {out:.1f} | {first:.1f} / {last:.1f} |")
        llm.close()


if __name__ == "__main__":
    main()
