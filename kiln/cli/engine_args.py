"""Engine options shared by every subcommand, with vLLM's names."""

from __future__ import annotations

import argparse
from typing import Any

from kiln.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser, engine_seed: bool = True) -> None:
    """`engine_seed=False` where --seed is the per-request sampling seed (generate, chat)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, help="sequences per step (default 64)")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="token budget per step, i.e. the prefill chunk (default 512 on the CPU, 2048 on CUDA)",
    )
    g.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
    g.add_argument(
        "--kv-cache-memory", help="KV cache budget, e.g. 2GiB (default: a fraction of free memory)"
    )
    g.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        help="fraction of free memory for the KV cache (default 0.2 CPU, 0.85 CUDA)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse KV blocks of shared prompt prefixes (default on)",
    )
    g.add_argument("--dtype", help="float32 (default), bfloat16 or float16")
    g.add_argument("--device", help="auto (default), cpu or cuda[:N]")
    g.add_argument(
        "--compilation-config",
        "-O",
        help='JSON, e.g. \'{"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}\' '
        "(vLLM's fields: mode, cudagraph_mode, cudagraph_capture_sizes, "
        "max_cudagraph_capture_size, splitting_ops, backend (inductor, aot_eager, eager), "
        "inductor_compile_config, debug_dump_path), or a field per flag as in vLLM: "
        "-O.mode=3 -O.cudagraph_capture_sizes+=1,2,4 -O.backend=eager",
    )
    g.add_argument(
        "--boot-timeout",
        type=float,
        help="seconds each boot phase (load, plan, graph memory, KV cache, warm-up/compile, "
        "capture) may take before it is reported with its stack and stopped; 0 = no limit "
        "(default 1800)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="no torch.compile, no CUDA graphs",
    )
    g.add_argument(
        "--strict-graphs",
        action="store_true",
        default=None,
        help="refuse to start when the graph plan would change the requested config",
    )
    g.add_argument(
        "--attention-backend",
        choices=["auto", "torch", "triton"],
        help="auto (default): triton on CUDA (capturable in FULL graphs), torch elsewhere",
    )
    if engine_seed:
        g.add_argument("--seed", type=int, help="engine seed for unseeded sampling (default 0)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "kv_cache_memory",
        "kv_cache_memory_fraction",
        "enable_prefix_caching",
        "dtype",
        "device",
        "seed",
        "compilation_config",
        "enforce_eager",
        "strict_graphs",
        "attention_backend",
        "boot_timeout",
    )
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument(
        "--seed",
        dest="sampling_seed",
        type=int,
        default=None,
        help="per-request seed: same seed, same output",
    )
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        stop=args.stop,
    )
