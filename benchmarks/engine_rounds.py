"""The same concurrent load, round after round, on one engine in this process (no server): each
round's wall time and output rate, its mean step time split into mixed steps (a prefill chunk
in them) and pure decode steps, and how scattered the KV blocks of its requests were (blocks
per run of consecutive ids in table order, as the CPU kernels read them: 1.0 is every block
alone). Separates what the engine does over its
life from what the server around it does (`kiln bench run --passes`).

    python benchmarks/engine_rounds.py --rounds 8 --streams 16 --prompt 512 --tokens 128
    python benchmarks/engine_rounds.py --prefill-weights packed --dtype bfloat16
    python benchmarks/engine_rounds.py --rounds 2 --streams 64 --attention-backend cpu-flash
    python benchmarks/engine_rounds.py --rounds 4 --kv-cache-prefault   # no fresh pages"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from kiln import LLM, SamplingParams


def _prompts(llm: LLM, streams: int, size: int, round_index: int) -> list[list[int]]:
    """Distinct prompts (no prefix-cache hits between requests or rounds) of `size` tokens."""
    from kiln.bench.prompts import SUITES, read_corpus

    corpus = llm.tokenizer.encode(read_corpus(SUITES["regular"]))
    out = []
    for i in range(streams):
        start = (round_index * streams + i) * 7 % (len(corpus) - size)
        out.append([1000 + round_index * streams + i, *corpus[start : start + size - 1]])
    return out


def _run_length(block_table: list[int]) -> float:
    """Blocks per run of consecutive ids in table order, as the CPU kernels read them."""
    runs = 1 + sum(1 for a, b in itertools.pairwise(block_table) if b != a + 1)
    return len(block_table) / runs


def one_round(
    llm: LLM, prompts: list[list[int]], tokens: int, min_tokens: int = 0
) -> dict[str, float]:
    engine = llm.engine
    params = SamplingParams(
        temperature=0, max_tokens=tokens, ignore_eos=True, min_tokens=min_tokens
    )
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", ids, params)
    mixed, decode, lengths = [], [], []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        lengths += [_run_length(s.block_table) for s in running if len(s.block_table) > 1]
        prefilling = any(s.num_uncomputed_tokens > 1 for s in running) or engine.scheduler.waiting
        start = time.perf_counter()
        engine.step()
        (mixed if prefilling else decode).append(time.perf_counter() - start)
    wall = time.perf_counter() - t0
    return {
        "wall s": wall,
        "output tok/s": len(prompts) * tokens / wall,
        "mixed steps": len(mixed),
        "mixed step ms": 1e3 * statistics.mean(mixed) if mixed else 0.0,
        "decode steps": len(decode),
        "decode step ms": 1e3 * statistics.mean(decode) if decode else 0.0,
        "blocks per run": statistics.mean(lengths) if lengths else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--mode", type=int, default=3)
    ap.add_argument("--prefill-weights", default="auto")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--model", default=None)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--cpu-linears", default="auto", choices=("auto", "onednn"))
    ap.add_argument("--kv-cache-prefault", action="store_true", help="fault the cache in at boot")
    ap.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    ap.add_argument(
        "--min-tokens", type=int, default=0, help="as `kiln bench` sends (= --tokens there)"
    )
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, compilation_config={"mode": args.mode},
              prefill_weights=args.prefill_weights, kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=max(16, args.streams), max_num_batched_tokens=512,
              attention_backend=args.attention_backend,
              cpu_linears=args.cpu_linears,
              kv_cache_prefault=args.kv_cache_prefault,
              **({"block_size": args.block_size} if args.block_size else {}))  # fmt: skip
    rows = []
    for r in range(args.rounds):
        rows.append(
            one_round(
                llm, _prompts(llm, args.streams, args.prompt, r), args.tokens, args.min_tokens
            )
        )
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in rows[-1].items()))
        compiled = llm.engine.runner.compile_stats()
        if compiled:
            print(
                f"  compilations {compiled['compilations']}, compile s {compiled['compile_s']}"
                f", recompilations {llm.engine.runner.recompilations}"
            )
    first, last = rows[0]["output tok/s"], rows[-1]["output tok/s"]
    print(f"last round / first round, output tok/s: {last / first:.3f}")


if __name__ == "__main__":
    main()
