"""`kiln generate | chat | info`. User mistakes print one line naming the remedy, never a
traceback."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from kiln.cli.dotted_args import DottedField, merge_dotted, split_dotted
from kiln.cli.engine_args import add_engine_args, add_sampling_args, engine_kwargs, sampling_params
from kiln.errors import ConfigError, KilnError


def _model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        "-m",
        default=None,
        help="a .gguf file or a local HF directory (default: the embedded SmolLM2-135M-Instruct)",
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from kiln.llm import LLM

    params = sampling_params(args)  # a bad flag fails before the model loads
    llm = LLM(args.model, **engine_kwargs(args))
    prompt = args.prompt
    if not args.raw and llm.tokenizer.has_chat_template:
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompt = llm.chat_prompt([*system, {"role": "user", "content": prompt}])
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.outputs[0].delta_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from kiln.cli.chat import run_chat

    return run_chat(args)


def cmd_info(args: argparse.Namespace) -> int:
    from kiln.cli.info import print_info

    return print_info(args)


def cmd_cache(args: argparse.Namespace) -> int:
    from kiln.cli.cache import run_cache

    return run_cache(args)


def _with_dotted(args: argparse.Namespace, dotted: list[DottedField]) -> str | None:
    if not hasattr(args, "compilation_config"):
        raise ConfigError(f"kiln {args.command} takes no compilation config ({dotted[0].flag})")
    return merge_dotted(args.compilation_config, dotted)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="kiln: LLM inference engine")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streaming")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--system", help="system prompt (chat template only)")
    _model_arg(gen)
    add_sampling_args(gen)
    add_engine_args(gen, engine_seed=False)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    chat.add_argument("--system", help="system prompt")
    _model_arg(chat)
    add_sampling_args(chat)
    add_engine_args(chat, engine_seed=False)
    chat.set_defaults(func=cmd_chat)

    info = sub.add_parser("info", help="the model's architecture and the resolved engine config")
    info.add_argument("model", nargs="?", default=None)
    info.add_argument(
        "--plan-only",
        action="store_true",
        help="resolve the configuration and print the graph plan without booting: no weights "
        "loaded, nothing compiled or captured (seconds, where a compiled boot takes minutes)",
    )
    add_engine_args(info)
    info.set_defaults(func=cmd_info)

    from kiln.cli.serve import add_serve_parser

    add_serve_parser(sub)

    from kiln.cli.bench import add_bench_parser

    add_bench_parser(sub)

    cache = sub.add_parser("cache", help="the compile cache: list or clear its entries")
    cache.add_argument("action", choices=["ls", "clear"])
    cache.add_argument("key", nargs="?", help="clear only this entry")
    cache.add_argument(
        "--stale",
        action="store_true",
        help="clear only the entries this installation can never load (built by another kiln "
        "source or torch version, or corrupted)",
    )
    cache.set_defaults(func=cmd_cache)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        argv, dotted = split_dotted(sys.argv[1:] if argv is None else argv)
    except KilnError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s kiln: %(message)s",
    )
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        if dotted:
            args.compilation_config = _with_dotted(args, dotted)
        return func(args)
    except KilnError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
