"""n-gram speculative decoding against plain decoding, side by side on one engine in this
process (the embedded model unless --model): rounds alternate between the two (the engine's
speculator switched off for the plain rounds), so both see the same weights, KV cache and
machine state.

Workloads, greedy, from the bench's corpora:
  edit   the coding suite's code, the model asked to return the file with one small change
  prose  the regular suite's narrative, the model asked to continue it
Each row: decode tokens/s per stream (output tokens after the first over the time from the
first to the last), the ratio to plain decoding measured in the same rounds, the acceptance
rate, the mean accepted length, and how many streams produced exactly plain decoding's
tokens. A sweep over concurrent streams shows where speculation stops paying (what
`disable_by_batch_size` defaults from).

    python benchmarks/speculative.py
    python benchmarks/speculative.py --k 2 4 --streams 1 2 4 8 --dtype bfloat16"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kiln import LLM, SamplingParams
from kiln.bench.prompts import SUITES, read_corpus
from kiln.spec.speculator import Speculator

INSTRUCTIONS = {
    "edit": (
        "coding",
        "Here is a Python file:\n\n```python\n{excerpt}\n```\n\nReturn the complete file, "
        "unchanged except for one edit: add the comment `# reviewed` as its first line.",
    ),
    "prose": (
        "regular",
        "Here is the beginning of a story:\n\n{excerpt}\n\nContinue the story in the same "
        "plain style.",
    ),
}


def prompts(llm: LLM, workload: str, count: int, excerpt_tokens: int) -> list[list[int]]:
    """`count` distinct chat prompts of the workload, each around one corpus excerpt."""
    suite, instruction = INSTRUCTIONS[workload]
    text = read_corpus(SUITES[suite])
    lines = text.splitlines(keepends=True)
    out = []
    for i in range(count):
        start, excerpt = (i * 97) % (len(lines) - 400), ""
        for line in lines[start:]:
            if len(llm.tokenizer.encode(excerpt + line)) > excerpt_tokens:
                break
            excerpt += line
        messages = [{"role": "user", "content": instruction.format(excerpt=excerpt)}]
        out.append(llm.chat_prompt(messages, True)["prompt_token_ids"])
    return out


def one_round(llm: LLM, batch: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """Mean decode tokens/s per stream, and each stream's output tokens."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens)
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(batch))]
    for rid, prompt in zip(ids, batch):
        engine.add_request(rid, prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    rates = []
    for out in finals.values():
        m, n = out.metrics, len(out.outputs[0].token_ids)
        if n > 1:
            rates.append((n - 1) / (m.finished_time - m.first_token_time))
    return statistics.mean(rates), [finals[rid].outputs[0].token_ids for rid in ids]


def measure(llm: LLM, spec: Speculator, batches, tokens: int, rounds: int) -> dict:
    """Alternating rounds, plain then speculative, on the same prompts."""
    engine = llm.engine
    plain, fast, same = [], [], []
    before = None
    for _ in range(rounds):
        for batch in batches:
            engine.speculator = None
            rate, want = one_round(llm, batch, tokens)
            plain.append(rate)
            engine.speculator = spec
            before = dict(vars(spec.stats)) if before is None else before
            rate, got = one_round(llm, batch, tokens)
            fast.append(rate)
            same += [a == b for a, b in zip(want, got)]
    return {
        "plain_tok_s": statistics.median(plain),
        "spec_tok_s": statistics.median(fast),
        "speedup": statistics.median(f / p for f, p in zip(fast, plain)),
        **acceptance(spec.stats, before),
        "same_tokens": f"{sum(same)}/{len(same)}",
    }


def acceptance(stats, before: dict) -> dict:
    """The speculator's acceptance since `before` (a copy of its stats' fields): the share of
    drafted tokens accepted, tokens per verified draft run, and drafting ms per run."""
    drafts = stats.num_drafts - before["num_drafts"]
    drafted = stats.num_draft_tokens - before["num_draft_tokens"]
    accepted = stats.num_accepted_tokens - before["num_accepted_tokens"]
    return {
        "acceptance": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
        "draft_ms_per_step": (stats.draft_s - before["draft_s"]) * 1e3 / max(drafts, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="auto", choices=["auto", "none"])
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4], help="speculative tokens")
    ap.add_argument("--lookup", type=int, nargs=2, default=[2, 5], metavar=("MIN", "MAX"))
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--excerpt", type=int, default=400, help="tokens of corpus per prompt")
    ap.add_argument("--tokens", type=int, default=192, help="max output tokens")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args()
    lo, hi = args.lookup
    rows = []
    for k in args.k:
        spec_config = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": lo,
            "prompt_lookup_max": hi,
            "disable_by_batch_size": max(args.streams),
        }
        llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization,
                  speculative_config=spec_config, kv_cache_memory="1GiB",
                  max_model_len=2048)  # fmt: skip
        spec = llm.engine.speculator
        for workload in INSTRUCTIONS:
            pool = prompts(llm, workload, max(args.streams), args.excerpt)
            for streams in args.streams if workload == "edit" else [1]:
                batches = [pool[:streams]]
                row = measure(llm, spec, batches, args.tokens, args.rounds)
                rows.append({"k": k, "workload": workload, "streams": streams, **row})
                print(_line(rows[-1]), flush=True)
        llm.close()
    print()
    print(_table(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def _line(r: dict) -> str:
    return (
        f"k={r['k']} {r['workload']:<5} streams={r['streams']:<2} plain {r['plain_tok_s']:6.1f} "
        f"spec {r['spec_tok_s']:6.1f} tok/s/stream  x{r['speedup']:.2f}  acceptance "
        f"{r['acceptance']:.0%}  mean accepted length {r['mean_accepted_length']:.2f}  "
        f"same tokens {r['same_tokens']}"
    )


def _table(rows: list[dict], args) -> str:
    lines = [
        f"n-gram lookup {args.lookup[0]}-{args.lookup[1]}, {args.dtype}, quantization "
        f"{args.quantization}, greedy, up to "
        f"{args.tokens} tokens, {args.rounds} rounds, medians",
        "",
        "| k | workload | streams | plain tok/s/stream | n-gram tok/s/stream | speedup "
        "| acceptance | mean accepted length | streams with plain's tokens |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['k']} | {r['workload']} | {r['streams']} | {r['plain_tok_s']:.1f} | "
            f"{r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | {r['acceptance']:.1%} | "
            f"{r['mean_accepted_length']:.2f} | {r['same_tokens']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
