"""Flags derived from the options of kiln.config (vLLM's names), and the sampling flags of
`generate` and `chat`. Light to import: nothing here loads torch."""

from __future__ import annotations

import argparse
from typing import Any

from kiln.config.options import Option, engine_options, server_options
from kiln.sampling_params import SamplingParams


def add_option(group: argparse._ArgumentGroup, opt: Option) -> None:
    """One option as a flag whose default is None: a profile or the config's default fills in
    what the command line leaves out."""
    kwargs: dict[str, Any] = {"dest": opt.name, "default": None, "help": opt.help}
    if opt.is_bool:
        kwargs["action"] = argparse.BooleanOptionalAction if opt.negatable else "store_true"
    elif opt.kind in (int, float):
        kwargs["type"] = opt.kind
    if opt.choices:
        kwargs["choices"] = opt.choices
    group.add_argument(*opt.cli_flags, **kwargs)


def add_engine_args(parser: argparse.ArgumentParser, engine_seed: bool = True) -> None:
    """`engine_seed=False` where --seed is the per-request sampling seed (generate, chat)."""
    group = parser.add_argument_group("engine")
    for opt in engine_options():
        if opt.name != "seed" or engine_seed:
            add_option(group, opt)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    for opt in server_options():
        add_option(group, opt)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line (or by a profile), as keywords."""
    names = [o.name for o in engine_options()]
    return {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}


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
