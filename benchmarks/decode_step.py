"""Where a single-stream decode step's time goes, per weight format, in one process.

For each configuration (quantization x dtype x compilation mode) this boots the embedded
model, decodes one greedy stream, and splits the mean step time into: the runner's input
preparation, the forward (and within it, from torch's profiler, the linear layers, attention
and everything else the forward calls), the LM head, sampling, and the engine's own work
around the runner (scheduler, block manager, detokenizer, output).

    python benchmarks/decode_step.py                       # the default configurations
    python benchmarks/decode_step.py --configs auto:float32:3 none:bfloat16:3 --tokens 128
    python benchmarks/decode_step.py --configs auto:bfloat16:3:torch auto:bfloat16:3:cpu \
        --context 7000                              # at 7k tokens of context, per attention backend
    python benchmarks/decode_step.py --configs none:bfloat16:3 --streams 16 --context 512
                                                    # a step of 16 concurrent streams
    python benchmarks/decode_step.py --model /tmp/moe.gguf --configs auto:float32:0 \
        none:float32:0                      # packed experts against dequantized ones (an MoE)

A configuration is QUANTIZATION:DTYPE[/KV_CACHE_DTYPE]:MODE[:ATTENTION_BACKEND[:INDUCTOR_OPTIONS]],
the last a JSON object of Inductor options (`auto:float32:3:auto:{"cpp_wrapper": true}`);
`auto:float32/bfloat16:3` is a float32 model over a bf16 KV cache (--kv-cache-dtype). Numbers are
milliseconds per decode step; the profiled rows count each op's own time under the nearest
linear, experts or attention op that called it (an attention op's flash kernel and copies are
attention). The last rows are the resident weight bytes and the rate."""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from kiln import LLM, SamplingParams

PROMPT = "Write a long story about a lighthouse keeper and her cat."
LINEAR_OPS = (
    "kiln::int4_mm",
    "kiln::bf16_mm",
    "kiln::int4_or_dense_mm",
    "kiln::onednn_linear",
    "mkldnn::_linear_pointwise",
    "aten::_weight_int4pack_mm_for_cpu",
    "aten::addmm",
    "aten::mm",
    "aten::matmul",
)
ATTENTION_OPS = ("kiln::cpu_paged_attention", "kiln::torch_paged_attention")
EXPERT_OPS = ("kiln::moe_experts",)  # and kiln::moe_experts_packed


class Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)

    @contextmanager
    def time(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.total[name] += time.perf_counter() - t0

    def wrap(self, owner, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            with self.time(name):
                return inner(*args, **kwargs)

        setattr(owner, attr, timed)


def measure(
    spec: str, tokens: int, threads: int, context: int, streams: int, model: str | None = None,
    cpu_linears: str = "auto", packed_activations: str = "auto",
) -> dict[str, float]:  # fmt: skip
    quantization, dtypes, mode, *rest = spec.split(":", 4)
    dtype, kv_dtype = [*dtypes.split("/"), "auto"][:2]
    backend, options = (rest + ["auto", "{}"][len(rest) :])[:2]
    torch.set_num_threads(threads)
    compilation = {"mode": int(mode), "inductor_compile_config": json.loads(options)}
    llm = LLM(model, quantization=quantization, dtype=dtype, compilation_config=compilation,
              attention_backend=backend, kv_cache_dtype=kv_dtype,
              cpu_linears=cpu_linears, packed_activations=packed_activations)  # fmt: skip
    prompt = _prompt(llm, context) if context else PROMPT
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([PROMPT], params)  # warm: every shape of this run compiled and seen
    engine, timers = llm.engine, Timers()
    runner = engine.runner
    timers.wrap(runner, "prepare", "prepare inputs")
    timers.wrap(runner, "_run", "forward")
    timers.wrap(runner.model, "compute_logits", "LM head")
    timers.wrap(engine.runner, "execute", "runner")
    steps, t0 = _decode(llm, prompt, params, timers, streams)
    wall = time.perf_counter() - t0
    row = {k: v * 1e3 / steps for k, v in timers.total.items()}
    ops = _forward_ops(llm, prompt, params, streams)
    runner_ms = row.pop("runner")
    row["sample"] = runner_ms - row["prepare inputs"] - row["forward"] - row["LM head"]
    row["engine (scheduler, output)"] = wall * 1e3 / steps - runner_ms
    row["step"] = wall * 1e3 / steps
    row.update({f"forward, profiled: {k}": v for k, v in ops.items()})
    row["resident weights, MiB"] = sum(b for _, _, b in runner.model.weight_summary) / 2**20
    return row


def _prompt(llm: LLM, num_tokens: int) -> str:
    """About `num_tokens` tokens of the benchmark's prose corpus."""
    from kiln.bench.prompts import SUITES, read_corpus

    ids = llm.tokenizer.encode(read_corpus(SUITES["regular"]))[:num_tokens]
    return llm.tokenizer.decode(ids)


def _prefill(engine, name: str, ids: list[int], params: SamplingParams, streams: int) -> None:
    """Steps until every stream's prompt is in the cache (chunked prefill: several steps).
    Each stream's prompt starts with its own token, so no two share a prefix-cache hit."""
    request_ids = [f"{name}-{i}" for i in range(streams)]
    for i, request_id in enumerate(request_ids):
        engine.add_request(request_id, [ids[(i + 1) % len(ids)], *ids], params)
    # a stream may finish all its tokens while later streams still prefill (few --tokens, many
    # --streams): it has left engine.requests, and counts as done
    while any(r in engine.requests and engine.requests[r].seqs[0].num_output_tokens == 0
              for r in request_ids):  # fmt: skip
        engine.step()


def _decode(llm: LLM, prompt: str, params: SamplingParams, timers: Timers, streams: int):
    """Decode steps only: the prefill steps run first, outside the timers' totals."""
    engine = llm.engine
    _prefill(engine, "timed", llm.tokenizer.encode(prompt), params, streams)
    timers.total.clear()
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps, t0


def _group(event) -> str:
    """The group of a profiled op: experts under an experts op (its matmuls too), else the
    nearest linear or attention op at or above it."""
    chain = []
    while event is not None:
        chain.append(event.name)
        event = event.cpu_parent
    if any(name.startswith(EXPERT_OPS) for name in chain):
        return "experts"
    for name in chain:
        if name.startswith(LINEAR_OPS):
            return "linears"
        if name.startswith(ATTENTION_OPS):
            return "attention"
    return "other ops"


def _forward_ops(llm: LLM, prompt: str, params: SamplingParams, streams: int) -> dict[str, float]:
    """ms per decode step in the forward's linears, attention and the rest (torch profiler:
    self CPU time of each op, attributed to the linear or attention op that called it)."""
    engine = llm.engine
    _prefill(engine, "profiled", llm.tokenizer.encode(prompt), params, streams)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        steps = 0
        while engine.has_unfinished_requests() and steps < 32:
            engine.step()
            steps += 1
    out = defaultdict(float)
    for event in prof.events():
        out[_group(event)] += event.self_cpu_time_total / 1e3 / steps
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["none:float32:0", "auto:float32:0", "none:bfloat16:3", "auto:float32:3"],
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--context", type=int, default=0, help="prompt tokens (default: short)")
    parser.add_argument("--streams", type=int, default=1, help="concurrent streams per step")
    parser.add_argument("--model", help="a model path (default: the embedded model)")
    parser.add_argument(
        "--cpu-linears", nargs="+", default=["auto"], choices=("auto", "onednn"),
        help="bf16 linears' kernel; two values measure each configuration with both",
    )  # fmt: skip
    parser.add_argument(
        "--packed-activations", nargs="+", default=["auto"],
        choices=("auto", "float", "int16", "int8"),
        help="how decode rows meet packed weights; several values measure each configuration "
        "with each",
    )  # fmt: skip
    args = parser.parse_args()
    rows = {
        _column(spec, linears, rows, args): measure(
            spec, args.tokens, args.threads, args.context, args.streams, args.model, linears,
            rows,
        )
        for spec in args.configs
        for linears in args.cpu_linears
        for rows in args.packed_activations
    }  # fmt: skip
    names = list(dict.fromkeys(k for row in rows.values() for k in row))
    print(f"\n{'ms per decode step':34}" + "".join(f"{s:>17}" for s in rows))
    for name in names:
        print(f"{name:34}" + "".join(f"{row.get(name, 0):17.2f}" for row in rows.values()))
    rates = "".join(f"{args.streams * 1e3 / row['step']:17.1f}" for row in rows.values())
    print(f"{'tokens/s (all streams)':34}" + rates)


def _column(spec: str, linears: str, rows: str, args: argparse.Namespace) -> str:
    """A configuration's column name: its spec, and the kernel choices measured several ways."""
    many_linears, many_rows = len(args.cpu_linears) > 1, len(args.packed_activations) > 1
    return spec + (f"/{linears}" if many_linears else "") + (f"/{rows}" if many_rows else "")


if __name__ == "__main__":
    main()
