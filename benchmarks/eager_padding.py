"""Resident memory and time of the engine under batches of every size, with the eager steps
padded to buckets (`--eager-step-padding`, kiln/runner/padding.py) and at their exact sizes.
Each setting runs in its own process (resident memory is per process), alternating, the same
seeded workload: rounds of 40 prompts of 3-250 words with 2-40 sampled tokens each.

    python benchmarks/eager_padding.py --rounds 10 --repeats 2"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time

WORDS = ["the", "lighthouse", "keeper", "wrote", "a", "long", "letter", "to", "the", "sea",
         "about", "storms", "and", "ships"]  # fmt: skip


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def worker(padding: str, rounds: int) -> dict:
    from kiln import LLM, SamplingParams

    llm = LLM(kv_cache_memory="512MiB", max_num_seqs=16, eager_step_padding=padding)
    rng, rss, times = random.Random(0), [], []
    for _ in range(rounds):
        prompts = [" ".join(rng.choices(WORDS, k=rng.randint(3, 250))) for _ in range(40)]
        params = [SamplingParams(max_tokens=rng.randint(2, 40), temperature=0.8) for _ in prompts]
        start = time.perf_counter()
        llm.generate(prompts, params)
        times.append(time.perf_counter() - start)
        rss.append(round(rss_mib(), 1))
    return {"padding": padding, "rss_mib": rss, "round_s": [round(t, 2) for t in times]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--repeats", type=int, default=1, help="processes per setting, alternating")
    p.add_argument("--worker", choices=["on", "off"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.rounds)))
        return
    runs = []
    for _ in range(args.repeats):
        for padding in ("on", "off"):
            cmd = [sys.executable, __file__, "--worker", padding, "--rounds", str(args.rounds)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
    # the KV cache's pages become resident as its blocks are first used, over the first rounds:
    # growth in the second half is what the per-shape caches add
    print("| padding | RSS after round 1 (MiB) | at half (MiB) | at the end (MiB) "
          "| second-half growth | total s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for r in runs:
        rss, half = r["rss_mib"], len(r["rss_mib"]) // 2 - 1
        total = sum(r["round_s"][1:])  # the first round pays one-time costs
        growth = rss[-1] - rss[half]
        print(f"| {r['padding']} | {rss[0]} | {rss[half]} | {rss[-1]} | {growth:+.1f} MiB "
              f"| {total:.1f} |")  # fmt: skip
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
