"""Every `kiln` subcommand's flags. Light to import (argparse and kiln.config, no torch): the
subcommand's own module, which loads the engine or the server, is imported only once the
command line has parsed (main.py)."""

from __future__ import annotations

import argparse
import os
import re

from kiln.cli.engine_args import add_engine_args, add_sampling_args, add_server_args
from kiln.default_model import HF_DTYPES


def parse_size(text: str) -> int:
    """'512', '1k' (1024), '16K', '1m' (1024*1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512, 1k, 16k)")
    scale = {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()]
    return int(m.group(1)) * scale


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="kiln: LLM inference engine")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _chat_parser(sub)
    _info_parser(sub)
    _serve_parser(sub)
    _bench_parser(sub)
    _cache_parser(sub)
    _export_hf_parser(sub)
    return parser


def _model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        "-m",
        default=None,
        help="a .gguf file or a local HF directory (default: the embedded SmolLM2-135M-Instruct)",
    )


def _generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate text for one prompt, streaming")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--system", help="system prompt (chat template only)")
    _model_arg(gen)
    add_sampling_args(gen)
    add_engine_args(gen, engine_seed=False)


def _chat_parser(sub) -> None:
    chat = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    chat.add_argument("--system", help="system prompt")
    _model_arg(chat)
    add_sampling_args(chat)
    add_engine_args(chat, engine_seed=False)


def _info_parser(sub) -> None:
    info = sub.add_parser("info", help="the model's architecture and the resolved engine config")
    info.add_argument("model", nargs="?", default=None)
    info.add_argument(
        "--plan-only",
        action="store_true",
        help="resolve the configuration and print the graph plan without booting: no weights "
        "loaded, nothing compiled or captured (seconds, where a compiled boot takes minutes)",
    )
    add_engine_args(info)


def _serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a .gguf file or a local HF directory (default: the embedded model)",
    )
    serve.add_argument(
        "--profile",
        help="a launcher profile (shipped name or .toml path) that sets every serving option; "
        "flags given here override it",
    )
    add_server_args(serve)
    add_engine_args(serve)


def _bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmark a server: cold, validated, side by side")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    run = bsub.add_parser("run", help="benchmark one running OpenAI-compatible server")
    run.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    run.add_argument("--model", help="model id to send (default: the first in /v1/models)")
    run.add_argument(
        "--profile", help="the configuration's name; a kiln profile also gives the probes"
    )
    run.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    _suite_args(run)
    matrix = bsub.add_parser("matrix", help="boot a fresh server per configuration, compare")
    matrix.add_argument("--model", help="model for every configuration (default: the profile's)")
    matrix.add_argument("--configs", nargs="+", default=[], help="profile names or .toml files")
    matrix.add_argument(
        "--cudagraph-modes",
        type=lambda s: [m.strip().upper() for m in s.split(",") if m.strip()],
        help="e.g. NONE,PIECEWISE,FULL: one configuration per mode from --profile",
    )
    matrix.add_argument("--profile", help="base profile for --cudagraph-modes")
    matrix.add_argument("--boot-timeout", type=float, default=900)
    _suite_args(matrix)


def _suite_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", default="all", choices=["regular", "coding", "all"])
    p.add_argument("--lane", default="all", choices=["performance", "quality", "all"])
    p.add_argument(
        "--sizes", nargs="+", type=parse_size, default=[1024, 4096], help="prompt tokens (1k=1024)"
    )
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--concurrency", nargs="+", type=int, default=[1])
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument(
        "--passes",
        type=int,
        default=1,
        help="run the whole load this many times on the same server, each pass reported on "
        "its own row (a server that slows down over its life shows it)",
    )
    p.add_argument("--max-retries", type=int, default=2, help="retries of a failed request")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600,
        help="seconds a response may go without a byte before the request fails (default 600; "
        "raise it for prefills of tens of thousands of tokens on a CPU)",
    )
    p.add_argument("--input-size-tolerance-percent", type=float, default=5.0)
    p.add_argument("--no-warmup", action="store_true", help="skip the small warm-up request")
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for servers that reject it; lengths may then mismatch)",
    )
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="the model's weights are random: skip the checks of the answers' text (repetition, "
        "word variety), which assume a trained model (a profile's random_weights = true does "
        "the same for its configuration)",
    )
    p.add_argument("--tokenizer", help="count prompt tokens with this .gguf / HF dir locally")
    p.add_argument("--output", help="report directory (default bench-results/<time>)")
    p.add_argument("--no-progress", action="store_true")


def _cache_parser(sub) -> None:
    cache = sub.add_parser("cache", help="the compile cache: list or clear its entries")
    cache.add_argument("action", choices=["ls", "clear"])
    cache.add_argument("key", nargs="?", help="clear only this entry")
    cache.add_argument(
        "--stale",
        action="store_true",
        help="clear only the entries this installation can never load (built by another kiln "
        "source or torch version, or corrupted)",
    )


def _export_hf_parser(sub) -> None:
    export = sub.add_parser(
        "export-hf",
        help="write a GGUF as an HF directory (safetensors + tokenizer), e.g. for vLLM",
        description="kiln export-hf [MODEL] [OUTPUT_DIR]: MODEL is a .gguf file (default: the "
        "embedded model; a single path is MODEL if it ends in .gguf, else OUTPUT_DIR); without "
        "OUTPUT_DIR the directory goes to kiln's cache (reused, and what a profile's "
        'model = "default-hf" names). Prints the directory\'s path.',
    )
    # one path is OUTPUT_DIR (export_hf.py sorts them out): argparse fills MODEL first
    export.add_argument("model", nargs="?", metavar="MODEL")
    export.add_argument("output", nargs="?", metavar="OUTPUT_DIR")
    export.add_argument(
        "--dtype", default="bf16", choices=list(HF_DTYPES), help="the weights' dtype (default bf16)"
    )
    # the command's module is kiln.cli.export_hf (main.py imports kiln.cli.<command>)
    export.set_defaults(command="export_hf")
