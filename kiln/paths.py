"""Where kiln keeps derived files (converted tokenizers, compile artifacts)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kiln.errors import ConfigError


def kiln_cache_dir() -> str:
    """$KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else ~/.cache/kiln."""
    if os.environ.get("KILN_CACHE_DIR"):
        return os.environ["KILN_CACHE_DIR"]
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "kiln")


def writable_dir(
    path: str | os.PathLike,
    what: str = "its cache directory",
    remedy: str = "set KILN_CACHE_DIR to a directory you can write",
) -> Path:
    """`path` (by default under kiln's cache directory), created, or an error naming the
    remedy: a directory kiln cannot write is a setting to change, not a traceback."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        problem = exc.strerror or str(exc)
    else:
        if os.access(path, os.W_OK | os.X_OK):
            return path
        problem = "not writable"
    raise ConfigError(f"kiln cannot write {what} {path} ({problem}). Remedy: {remedy}")


def write_atomically(path: Path, data: bytes) -> None:
    """Readers of `path` see the old file or the whole new one, never a part: written beside
    it, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
