"""Speculative decoding on a hybrid model, side by side with plain decoding: a random-weight
model with Qwen3-Next's layer mix (benchmarks/graph_modes.py: random_qwen3_next) given a
random MTP head (tests/helpers.py: add_mtp_head). Rounds alternate between plain decoding and
speculation on one engine in this process (its speculator switched off for the plain rounds):
same prompts, same machine state. Greedy; the speculative rounds' tokens must equal the plain
rounds' (counted).

Two drafters:
  mtp     the checkpoint's MTP head. A random head's drafts are all rejected, so this row is
          the price of MTP at zero acceptance: every step drafts (the head's catch-up over
          the kept positions and its k - 1 chained steps) and verifies 1 + k tokens for one.
  oracle  drafts taken from the plain round's tokens, each right with probability --accept
          (seeded): what a trained drafter's acceptance buys on this model, and what a
          rejection costs (the Gated DeltaNet state after the last kept token is taken back).

Each row: ms per output token after the first, plain and speculative, their ratio, the
acceptance rate, the mean accepted length, and the drafting time per step.

    PYTHONPATH=. python benchmarks/hybrid_spec.py
    PYTHONPATH=. python benchmarks/hybrid_spec.py --k 2 --accept 0.9 0.6 --streams 1 4"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch
from graph_modes import random_qwen3_next
from speculative import acceptance

from kiln import LLM, SamplingParams
from tests.helpers import add_mtp_head


def model_with_head(dtype: str) -> str:
    path = random_qwen3_next(dtype) + "-mtp"
    return path if os.path.isdir(path) else add_mtp_head(random_qwen3_next(dtype), path)


def one_round(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, list]:
    """ms per output token after the first (all streams), and each stream's tokens."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    engine.step()  # the prompts' prefill, which samples each stream's first token
    finals, start = {}, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    ms = (time.perf_counter() - start) * 1e3 / (len(prompts) * (tokens - 1))
    return ms, [finals[rid].outputs[0].token_ids for rid in ids]


def oracle(spec, want: dict[int, list[int]], accept: float, seed: int):
    """A drafter that proposes the plain round's next tokens (found by prompt length), each
    right with probability `accept` (a wrong one is the right one plus one)."""
    rng = random.Random(seed)

    def drafts(seq):
        k = spec.config.num_speculative_tokens
        room = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
        right = want[seq.num_prompt_tokens][seq.num_output_tokens :][:room]
        return [t if rng.random() < accept else t + 1 for t in right]

    return drafts


def measure(llm: LLM, prompts, tokens: int, rounds: int, accept: float | None) -> dict:
    engine, spec = llm.engine, llm.engine.speculator
    plain, fast, same = [], [], []
    before = dict(vars(spec.stats))
    for r in range(rounds):
        engine.speculator = None
        ms, want = one_round(llm, prompts, tokens)
        plain.append(ms)
        engine.speculator = spec
        if accept is not None:
            spec._drafts = oracle(spec, {len(p): w for p, w in zip(prompts, want)}, accept, r)
        ms, got = one_round(llm, prompts, tokens)
        fast.append(ms)
        same += [a == b for a, b in zip(want, got)]
    return {
        "plain_ms": statistics.median(plain),
        "spec_ms": statistics.median(fast),
        "ratio": statistics.median(f / p for f, p in zip(fast, plain)),
        **acceptance(spec.stats, before),
        "same_tokens": f"{sum(same)}/{len(same)}",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--mode", type=int, default=0, help="compilation mode")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--accept", type=float, nargs="+", default=[0.9, 0.7],
                    help="the oracle drafter's rate of right drafts")  # fmt: skip
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = model_with_head(args.dtype)
    g = torch.Generator().manual_seed(0)
    pool = [torch.randint(10, 32000, (args.prompt + i,), generator=g).tolist() for i in range(8)]
    rows = []
    for k in args.k:
        for drafter, accept in [("mtp", None), *[("oracle", a) for a in args.accept]]:
            spec = {"method": drafter if drafter == "mtp" else "ngram",
                    "num_speculative_tokens": k,
                    "disable_by_batch_size": max(args.streams)}  # fmt: skip
            llm = LLM(path, dtype=args.dtype, speculative_config=spec, kv_cache_memory="512MiB",
                      compilation_config={"mode": args.mode}, max_model_len=2048)  # fmt: skip
            for streams in args.streams:
                row = measure(llm, pool[:streams], args.tokens, args.rounds, accept)
                rows.append({"k": k, "drafter": drafter, "accept": accept, "streams": streams,
                             **row})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
            llm.close()
    print(_table(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def _table(rows: list[dict], args) -> str:
    lines = [
        f"random Qwen3-Next (8 layers, hidden 512, 32 experts) with a random MTP head, "
        f"{args.dtype}, mode {args.mode}, ~{args.prompt}-token prompts, {args.tokens} tokens, "
        f"{args.rounds} rounds, medians",
        "",
        "| k | drafter | streams | plain ms/token | speculative ms/token | ratio | acceptance "
        "| mean accepted length | drafting ms/step | streams with plain's tokens |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        who = "MTP head (random)" if r["drafter"] == "mtp" else f"oracle, {r['accept']:.0%} right"
        lines.append(
            f"| {r['k']} | {who} | {r['streams']} | {r['plain_ms']:.1f} | {r['spec_ms']:.1f} | "
            f"{r['ratio']:.2f}x | {r['acceptance']:.0%} | {r['mean_accepted_length']:.2f} | "
            f"{r['draft_ms_per_step']:.1f} | {r['same_tokens']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
