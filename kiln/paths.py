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
    it, then renamed over it. The file gets the mode a plain open would (0666 less the umask),
    not mkstemp's 0600, which would shut the other users of a shared cache out of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}")
    os.fchmod(fd, 0o666 & ~process_umask())
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def temp_dir_in(parent: Path) -> str:
    """A new directory in `parent` to fill and rename into place, with the mode mkdir would
    give it (0777 less the umask) rather than mkdtemp's 0700."""
    tmp = tempfile.mkdtemp(dir=parent)
    os.chmod(tmp, 0o777 & ~process_umask())
    return tmp


def process_umask() -> int:
    """This process's umask, read without changing it (os.umask can only set it, and setting
    it for a moment would race other threads creating files): from /proc on Linux, else 022."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
