"""`debug_dump_path`: what each compilation made, written where a user can read it (vLLM's
option of that name). One directory per compilation: the graph Dynamo traced, the split graph
with every piece's FX code, an index of the pieces with their input shapes, and the code
Inductor generated for each piece (its cached code too, on a boot that reuses the entry)."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import torch

from kiln.errors import ConfigError
from kiln.paths import writable_dir

logger = logging.getLogger(__name__)


def dump_root(path: str) -> Path:
    """The dump directory, created, or an error naming the remedy (checked at boot, before
    anything compiles)."""
    remedy = "set debug_dump_path to a directory you can write"
    return writable_dir(path, what="debug_dump_path", remedy=remedy)


class GraphDump:
    def __init__(self, root: Path, backend: str) -> None:
        self.root, self.backend = root, backend

    def write(
        self,
        traced: torch.fx.GraphModule,
        split: torch.fx.GraphModule,
        is_split: dict[str, bool],
        piece_inputs: dict[str, list],
        compiled: dict[str, Any],
    ) -> Path:
        """Write one compilation: `compiled` maps a piece's name to what replaces it (call
        before it does)."""
        out = self._next_dir()
        readable = {"include_stride": True, "include_device": True, "print_output": False}
        _write(out / "dynamo_graph.py", traced.print_readable(**readable))
        _write(out / "split_graph.py", split.print_readable(**readable))
        lines = [f"{'graph':<12} {'kind':<14} {'runs on':<10} inputs"]
        for name, splits in is_split.items():
            kind, runs = ("splitting op", "eager") if splits else ("piece", self.backend)
            inputs = _describe(piece_inputs.get(name, []))
            lines.append(f"{name:<12} {kind:<14} {runs:<10} {inputs}")
            code = getattr(getattr(compiled.get(name), "fn", None), "source_code", None)
            if code:
                _write(out / f"{name}.inductor.py", code)
        _write(out / "pieces.txt", "\n".join(lines) + "\n")
        logger.info("compiled graphs written to %s", out)
        return out

    def _next_dir(self) -> Path:
        """A fresh directory: engines of one process, and later processes, add theirs."""
        for i in itertools.count():
            out = self.root / f"compilation_{i}"
            try:
                out.mkdir()
            except FileExistsError:
                continue
            except OSError as exc:
                raise ConfigError(f"kiln cannot write debug_dump_path {out}: {exc}") from None
            return out
        raise AssertionError("unreachable")


def _describe(inputs: list) -> str:
    parts = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            dtype = str(x.dtype).removeprefix("torch.")
            parts.append(f"{dtype}{list(x.shape)} stride {list(x.stride())}")
        else:
            parts.append(type(x).__name__ if not isinstance(x, (int, torch.SymInt)) else str(x))
    return "; ".join(parts) or "(none)"


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise ConfigError(f"kiln cannot write debug_dump_path {path}: {exc}") from None
