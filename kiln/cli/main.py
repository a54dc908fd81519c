"""`kiln generate | chat | info | serve | bench | cache`. User mistakes print one line naming
the remedy, never a traceback.

The command line parses with light modules only (parsers.py); the chosen subcommand's module
(`kiln.cli.<command>`, with its `run(args)`) is imported after that, so `kiln bench` (an HTTP
client) and every `--help` start without loading torch."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kiln.cli.dotted_args import DottedField, merge_dotted, split_dotted
from kiln.cli.parsers import build_parser
from kiln.errors import ConfigError, KilnError


def _with_dotted(args: argparse.Namespace, dotted: list[DottedField]) -> str | None:
    if not hasattr(args, "compilation_config"):
        raise ConfigError(f"kiln {args.command} takes no compilation config ({dotted[0].flag})")
    return merge_dotted(args.compilation_config, dotted)


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
    try:
        if dotted:
            args.compilation_config = _with_dotted(args, dotted)
        command = importlib.import_module(f"kiln.cli.{args.command}")
        return command.run(args)
    except KilnError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
