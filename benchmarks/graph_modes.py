"""Decode step time and prefill throughput per compilation / CUDA-graph configuration, side by
side in one run, with ratios to the first configuration.

    python benchmarks/graph_modes.py                      # CPU: mode 0 vs mode 3, embedded model
    python benchmarks/graph_modes.py --model qwen3-0.6b-random --dtype bfloat16   # GPU shapes
    python benchmarks/graph_modes.py --model qwen3-next-random     # Qwen3-Next's mix, scaled

On a CUDA device the default configurations are a mode-0 baseline and the five graph modes under
mode 3, each capturing graphs at the measured batch sizes (see gpu_config); the table shows what
each resolved to (the plan), so a configuration that was changed is visible next to its numbers.

On the CPU every configuration is booted first and measured `--rounds` times (default 3),
interleaved, and the table shows medians over rounds, then every round's values: a shared
machine's speed drifts over minutes, and one configuration measured after the other would take
that drift for a difference between them. Each CPU round also times the b=1 floor: the model's
linears and LM head alone at one row (the weights a decode step streams, on the kernels it
calls), and a line after the table gives each configuration's b=1 step as a multiple of it,
which bounds what compilation can gain there. On a GPU the default is one round, one engine at
a time (each sizes its KV cache from free memory)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from kiln import LLM, SamplingParams
from kiln.loader.tokenizer import word_level_tokenizer

# the targets compare FULL with NONE and PIECEWISE with FULL first: a run cut short by a time
# limit has those rows
GRAPH_MODES = ["FULL", "PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "NONE"]


def random_qwen3_0_6b(dtype: str, num_layers: int = 28) -> str:
    """A random-weight model with Qwen3-0.6B's shapes (no download), saved as an HF directory;
    fewer layers for tests that need its widths only."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    name = f"kiln-qwen3-0.6b-random-{dtype}" + ("" if num_layers == 28 else f"-{num_layers}l")
    path = os.path.join(tempfile.gettempdir(), name)
    if os.path.isdir(path):
        return path
    cfg = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=num_layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    )
    Qwen3ForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path)
    word_level_tokenizer(cfg.vocab_size).save_pretrained(path)
    return path


def random_qwen3_next(dtype: str) -> str:
    """A random-weight hybrid with Qwen3-Next's layer mix scaled to a small CPU: 8 layers, three
    Gated DeltaNet layers to one gated-attention layer (Qwen3-Next's full_attention_interval of
    4), 32 experts of which 4 route per token plus a shared expert, in every layer."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    path = os.path.join(tempfile.gettempdir(), f"kiln-qwen3-next-random-{dtype}")
    if os.path.isdir(path):
        return path
    cfg = Qwen3NextConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=32,
        num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=256,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
    )  # fmt: skip
    Qwen3NextForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path)
    word_level_tokenizer(cfg.vocab_size).save_pretrained(path)
    return path


RANDOM_MODELS = {"qwen3-0.6b-random": random_qwen3_0_6b, "qwen3-next-random": random_qwen3_next}


def _decode_ms(llm: LLM, batch: int, steps: int, vocab: int, salt: int) -> float:
    eng = llm.engine
    for i in range(batch):
        start = 7 * i + 101 * batch + 1009 * salt  # no two measured prompts share a prefix
        prompt = [(start + j) % (vocab - 10) + 5 for j in range(32)]
        params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
        eng.add_request(f"d{batch}-{i}", prompt, params)
    pending = eng.scheduler.running + list(eng.scheduler.waiting)
    while any(s.num_output_tokens == 0 for s in pending):  # all prefills done
        eng.step()
    eng.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    while eng.has_unfinished_requests():
        eng.step()
    return statistics.median(times) * 1e3


def measure(llm: LLM, batches: list[int], prefill_len: int, steps: int, salt: int = 0) -> dict:
    """`salt` varies the prompts, so that a second measurement of one engine hits no prefix
    cache."""
    vocab = min(llm.engine.model_config.vocab_size, 49152)
    decode = {b: _decode_ms(llm, b, steps, vocab, salt) for b in batches}
    params = SamplingParams(max_tokens=1)
    llm.generate({"prompt_token_ids": [(3 * j) % 4000 + 5 for j in range(prefill_len)]}, params)
    res = llm.generate(
        {"prompt_token_ids": [(5 * j + 1 + 7 * salt) % 4000 + 5 for j in range(prefill_len)]},
        params,
    )[0]
    return {
        "decode_ms": decode,
        "prefill_tok_s": prefill_len / res.metrics.time_to_first_token,
        "graphs": llm.engine.stats().graphs,
    }


def linears_ms(llm: LLM, passes: int = 20) -> float:
    """The b=1 decode floor that compilation cannot lower on the CPU: every linear layer of
    the model and the LM head run once at one row, through the kernels a step calls (oneDNN's
    prepacked weights), nothing else (median of `passes`). A decode step must stream these
    weights; what it spends above this is attention, elementwise ops and host overhead. The
    experts of an MoE model are not linear layers: they are not in the floor."""
    from kiln.layers.linear import Linear

    model = llm.engine.runner.model
    dtype = next(model.parameters()).dtype
    lm_head = getattr(model, "lm_head", None)  # compute_logits runs it (or the tied embedding)
    layers = [m for m in model.modules() if isinstance(m, Linear) and m is not lm_head]
    rows = [torch.randn(1, m.in_features, dtype=dtype) for m in layers]
    hidden = torch.randn(1, llm.engine.model_config.hidden_size, dtype=dtype)
    times = []
    with torch.inference_mode():
        for _ in range(passes + 2):  # two to warm up
            t = time.perf_counter()
            for layer, x in zip(layers, rows):
                layer(x)
            model.compute_logits(hidden)
            times.append(time.perf_counter() - t)
    return statistics.median(times[2:]) * 1e3


def floor_line(rows: list[dict], floors: list[float]) -> str:
    floor = statistics.median(floors)
    ratios = ", ".join(f"{r['config']} {r['decode_ms'][1] / floor:.2f}x" for r in rows)
    rounds = " ".join(f"{f:.1f}" for f in floors)
    return (
        f"b=1 floor (the linears and the LM head alone, one row each): {floor:.1f} ms "
        f"(rounds {rounds}); decode b=1 at {ratios} of it"
    )


def table_head(batches: list[int]) -> str:
    head = ["config", "resolved", "boot s", "graphs (s, GiB)"]
    head += [*[f"decode ms b={b}" for b in batches], "prefill tok/s"]
    return "| " + " | ".join(head) + " |\n|" + " --- |" * len(head)


def table_row(r: dict, base: dict, batches: list[int]) -> str:
    cap = r["capture"]
    graphs = f"{cap['graphs']} ({cap['seconds']:.1f}, {cap['memory_bytes'] / 2**30:.2f})"
    cells = [r["config"], r["resolved"], f"{r['boot_s']:.0f}", graphs]
    for b in batches:
        ms = r["decode_ms"][b]
        cells.append(f"{ms:.1f} ({base['decode_ms'][b] / ms:.2f}x)")
    ratio = r["prefill_tok_s"] / base["prefill_tok_s"]
    cells.append(f"{r['prefill_tok_s']:.0f} ({ratio:.2f}x)")
    return "| " + " | ".join(cells) + " |"


def table(rows: list[dict], batches: list[int]) -> str:
    return "\n".join([table_head(batches), *(table_row(r, rows[0], batches) for r in rows)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model",
        help="a path, qwen3-0.6b-random or qwen3-next-random (default: the embedded model)",
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--prefill-len", type=int)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--configs", nargs="+", help="compilation configs as JSON")
    parser.add_argument("--output")
    parser.add_argument(
        "--rounds",
        type=int,
        help="measure every configuration this many times, interleaved (default: 3 on the CPU, "
        "1 on a GPU)",
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    make = RANDOM_MODELS.get(args.model)
    model = make(args.dtype) if make else args.model
    batches = args.batches or ([1, 8, 32, 128] if cuda else [1, 8, 32])
    if args.configs:
        configs = args.configs
    elif cuda:
        configs = ['{"mode": 0, "cudagraph_mode": "NONE"}']
        configs += [gpu_config(m, batches) for m in GRAPH_MODES]
    else:
        configs = ['{"mode": 0}', '{"mode": 3}']
    prefill_len = args.prefill_len or (2048 if cuda else 512)
    args.rounds = args.rounds or (1 if cuda else 3)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    boot = dict(
        dtype=args.dtype,
        max_model_len=4096,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(prefill_len, max(batches)),
        # engines that coexist (rounds > 1) cannot each size their cache from free GPU memory
        kv_cache_memory="4GiB" if not cuda or args.rounds > 1 else None,
    )
    floors: list[float] = []
    if args.rounds > 1:
        rows, floors = interleaved(model, configs, boot, batches, prefill_len, args)
    else:
        rows = sequential(model, configs, boot, batches, prefill_len, args)
    print("\n" + table(rows, batches))
    if floors and 1 in batches:
        print("\n" + floor_line(rows, floors))
    if args.rounds > 1:
        print("\nevery round (decode ms per batch size; prefill tok/s):")
        for r in rows:
            per_batch = "; ".join(
                f"b={b} " + " ".join(f"{ms:.1f}" for ms in r["decode_ms_rounds"][b])
                for b in batches
            )
            prefill = " ".join(f"{x:.0f}" for x in r["prefill_tok_s_rounds"])
            print(f"  {r['config']}: {per_batch}; prefill {prefill}")


def gpu_config(graph_mode: str, batches: list[int]) -> str:
    """Graphs captured at the measured batch sizes only: a decode batch of b pads to b under
    the default ladder too, so the step times are the same, and each boot captures 4 sizes
    instead of 67 (x 29 pieces under PIECEWISE). The prefill runs above the ladder either way."""
    config = {"mode": 3, "cudagraph_mode": graph_mode, "cudagraph_capture_sizes": batches}
    return json.dumps(config)


def boot_engine(model: str | None, cfg: str, boot: dict) -> tuple[LLM, dict]:
    t0 = time.perf_counter()
    llm = LLM(model, compilation_config=cfg, **boot)
    plan = llm.engine.plan
    row = {
        "config": cfg,
        "resolved": f"mode {plan.mode} {plan.cudagraph_mode.value}",
        "boot_s": time.perf_counter() - t0,
        "capture": llm.engine.boot.capture.to_dict(),
    }
    return llm, row


def sequential(model, configs, boot, batches, prefill_len, args) -> list[dict]:
    """One configuration at a time, each engine closed before the next boots (on a GPU the next
    sizes its KV cache from the memory this frees)."""
    rows = []
    print(table_head(batches), flush=True)
    for cfg in configs:
        llm, row = boot_engine(model, cfg, boot)
        rows.append({**row, **measure(llm, batches, prefill_len, args.steps)})
        llm.close()
        del llm
        # each row as soon as it is measured: a run cut short by a time limit still reports
        print(table_row(rows[-1], rows[0], batches), flush=True)
        if args.output:
            save(args.output, torch.cuda.is_available(), rows)
    return rows


def interleaved(model, configs, boot, batches, prefill_len, args) -> tuple[list[dict], list[float]]:
    """Every engine booted first, then measured in rounds, the order rotated each round: this
    machine's speed drifts by tens of percent over minutes (docs/performance.md), which
    measuring one configuration after the other would book as a difference between them."""
    engines = [boot_engine(model, cfg, boot) for cfg in configs]
    samples: list[list[dict]] = [[] for _ in engines]
    floors: list[float] = []
    for r in range(args.rounds):
        for i in [(r + k) % len(engines) for k in range(len(engines))]:
            samples[i].append(measure(engines[i][0], batches, prefill_len, args.steps, salt=r))
        if not torch.cuda.is_available():
            floors.append(linears_ms(engines[0][0]))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    rows = [{**row, **merge(s)} for (_, row), s in zip(engines, samples)]
    for llm, _ in engines:
        llm.close()
    if args.output:
        save(args.output, torch.cuda.is_available(), rows, floors)
    return rows, floors


def merge(samples: list[dict]) -> dict:
    """Median over rounds, with every round's value kept for the spread."""
    batches = samples[0]["decode_ms"]
    return {
        "decode_ms": {b: statistics.median(s["decode_ms"][b] for s in samples) for b in batches},
        "decode_ms_rounds": {b: [s["decode_ms"][b] for s in samples] for b in batches},
        "prefill_tok_s": statistics.median(s["prefill_tok_s"] for s in samples),
        "prefill_tok_s_rounds": [s["prefill_tok_s"] for s in samples],
        "graphs": samples[-1]["graphs"],
    }


def save(path: str, cuda: bool, rows: list[dict], floors: list[float] | None = None) -> None:
    with open(path, "w") as f:
        device = "cuda" if cuda else "cpu"
        result = {"device": device, "torch": torch.__version__, "rows": rows}
        if floors:
            result["b1_linears_floor_ms_rounds"] = floors
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
