"""The `kiln` command."""

from kiln.cli.main import main

__all__ = ["main"]
