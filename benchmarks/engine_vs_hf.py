"""kiln vs HF transformers `generate` on this machine, same model (the embedded SmolLM2-135M,
fp32), one run: single-stream decode, 16-way concurrent decode, 1,000-token prefill, peak memory,
and the memory-bandwidth bound for decode measured in the same run.

    python benchmarks/engine_vs_hf.py [--output results.json]

Each side runs in its own subprocess so that peak memory is its own."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "changed how knowledge travelled across Europe. Workshops spread from city to city, and "
    "with them came new habits of reading, new trades, and new arguments about who should be "
    "allowed to publish what. "
)


def prompt_ids(tokenizer, n: int, salt: int = 0) -> list[int]:
    ids = tokenizer.encode(f"[{salt}] " + TEXT * (n // 40 + 2), add_special_tokens=False)
    return ids[:n]


def bandwidth_bound(num_params: int, repeats: int = 10) -> dict:
    """Time for one matrix-vector product over num_params fp32 weights (best layout, best of
    `repeats`): the floor for one decode step that must stream every weight once."""
    cols = 576
    w = torch.randn(num_params // cols, cols)
    wt = w.t().contiguous()
    x = torch.randn(1, cols)
    best = float("inf")
    for f in (lambda: torch.mv(w, x[0]), lambda: x @ wt, lambda: torch.mv(wt.t(), x[0])):
        f()
        for _ in range(repeats):
            t = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t)
    return {"ms_per_token": best * 1e3, "GB_per_s": num_params * 4 / best / 1e9}


def kiln_side() -> dict:
    from kiln import LLM, SamplingParams

    llm = LLM(kv_cache_memory="1GiB", max_num_seqs=16)
    tok = llm.tokenizer
    llm.generate(prompt_ids(tok, 32, 99), SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    out = llm.generate(
        {"prompt_token_ids": prompt_ids(tok, 32)},
        SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
    )[0]
    times = out.outputs[0].metrics.token_times
    single = (len(times) - 1) / (times[-1] - times[0])
    prompts = [{"prompt_token_ids": prompt_ids(tok, 128, i)} for i in range(16)]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    wall = time.perf_counter() - t
    generated = sum(o.num_completion_tokens for o in outs)
    first = min(o.outputs[0].metrics.token_times[0] for o in outs)
    last = max(o.outputs[0].metrics.token_times[-1] for o in outs)
    long = llm.generate(
        {"prompt_token_ids": prompt_ids(tok, 1000)}, SamplingParams(temperature=0, max_tokens=1)
    )[0]
    return {
        "single_decode_tok_s": single,
        "concurrent16_tok_s": generated / wall,
        "concurrent16_decode_tok_s": (generated - 16) / (last - first),
        "prefill_1000_tok_s": 1000 / long.metrics.time_to_first_token,
        "num_params": llm.engine.model_config.num_params,
        "peak_rss_GiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def hf_side() -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    from kiln.default_model import default_model_path

    folder, name = os.path.split(default_model_path())
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def run(ids: list[int], n: int, clock=None):
        return model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
            streamer=clock,
        )

    run(prompt_ids(tok, 32, 99), 8)  # warm-up
    clock = Clock()
    run(prompt_ids(tok, 32), 128, clock)
    decode_times = clock.times[1:]  # the first put is the prompt
    single = (len(decode_times) - 1) / (decode_times[-1] - decode_times[0])
    t = time.perf_counter()
    run(prompt_ids(tok, 1000), 1)
    prefill = 1000 / (time.perf_counter() - t)
    return {
        "single_decode_tok_s": single,
        "prefill_1000_tok_s": prefill,
        "peak_rss_GiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def table(k: dict, h: dict, bound: dict) -> str:
    bound_tok_s = 1e3 / bound["ms_per_token"]
    rows = [
        (
            "single-stream decode tok/s (prompt 32, 128 new)",
            k["single_decode_tok_s"],
            h["single_decode_tok_s"],
            f"{k['single_decode_tok_s'] / h['single_decode_tok_s']:.2f}x HF",
        ),
        (
            "  share of the bandwidth bound",
            f"{k['single_decode_tok_s'] / bound_tok_s:.0%}",
            f"{h['single_decode_tok_s'] / bound_tok_s:.0%}",
            f"bound {bound['ms_per_token']:.1f} ms/token ({bound['GB_per_s']:.1f} GB/s)",
        ),
        (
            "16 concurrent, tok/s (prompt 128, 128 new)",
            k["concurrent16_tok_s"],
            "-",
            f"{k['concurrent16_tok_s'] / h['single_decode_tok_s']:.1f}x HF single-stream",
        ),
        (
            "  decode phase only",
            k["concurrent16_decode_tok_s"],
            "-",
            f"{k['concurrent16_decode_tok_s'] / h['single_decode_tok_s']:.1f}x HF single-stream",
        ),
        (
            "prefill tok/s (1,000-token prompt)",
            k["prefill_1000_tok_s"],
            h["prefill_1000_tok_s"],
            f"{k['prefill_1000_tok_s'] / h['prefill_1000_tok_s']:.2f}x HF",
        ),
        ("peak RSS GiB", k["peak_rss_GiB"], h["peak_rss_GiB"], ""),
    ]

    def cell(v) -> str:
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| measure | kiln | HF transformers | ratio |", "| --- | --- | --- | --- |"]
    lines += [f"| {a} | {cell(b)} | {cell(c)} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", choices=["kiln", "hf"])
    parser.add_argument("--output")
    args = parser.parse_args()
    if args.side:
        print(json.dumps(kiln_side() if args.side == "kiln" else hf_side()))
        return
    results = {}
    for side in ("kiln", "hf"):
        proc = subprocess.run(
            [sys.executable, __file__, "--side", side], capture_output=True, text=True, check=True
        )
        results[side] = json.loads(proc.stdout.strip().splitlines()[-1])
    results["bound"] = bandwidth_bound(results["kiln"]["num_params"])
    results["machine"] = {
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    print(table(results["kiln"], results["hf"], results["bound"]))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
