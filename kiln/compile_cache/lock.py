"""One lock per compile cache entry, so that kiln processes booting the same configuration at
once (replicas of a server, a benchmark beside a server) share one compilation instead of
deleting each other's: the process that compiles into an entry holds it exclusively until the
entry is sealed; one that finds an entry sealed holds it shared while its own boot reads it.

A process that opens an entry another one is compiling waits for it (and says so), then reuses
what it sealed. The locks are `flock`s, which the kernel drops when their process dies: an entry
left without a manifest and without a holder is a compilation that crashed, and is rebuilt.

Lock files live in `<root>/.locks/` and are never deleted: removing one while another process
waits on it would let a third create a new file and lock it too, two owners of one entry.

Processes that must boot in step (tensor-parallel ranks, whose warm-up runs collectives) need
entries of their own, keyed by rank as vLLM's rank_i_j directories are: sharing one, a rank
would wait on this lock while the rank holding it waits on the first rank's collectives."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

LOCKS_DIR = ".locks"
POLL_S = 0.1  # how often a waiting process retries; waits stay interruptible by --boot-timeout


def lock_path(entry: Path) -> Path:
    return entry.parent / LOCKS_DIR / f"{entry.name}.lock"


class EntryLock:
    """The lock of one entry. `on_wait(owner)` is called once when an acquisition has to wait,
    with what the holder wrote about itself."""

    def __init__(self, entry: Path) -> None:
        self.path = lock_path(entry)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # 0666 less the umask, as a plain open: in a cache shared by a group, another user
        # must be able to lock it too; flock needs only a read-only descriptor, so one that
        # can read but not write the file locks it and leaves its owner line as it is
        self.writable = True
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError:
            fd, self.writable = os.open(self.path, os.O_RDONLY), False
        self.file: IO[str] | None = os.fdopen(fd, "r+" if self.writable else "r")
        self.mode: int | None = None
        self.unsupported = False  # a filesystem without flock: warned about, then unlocked

    def shared(self, on_wait: Callable[[str], None] | None = None) -> float:
        """Seconds spent waiting for it (0.0 when nobody held it)."""
        return self._acquire(fcntl.LOCK_SH, on_wait)

    def exclusive(self, on_wait: Callable[[str], None] | None = None) -> float:
        """Drops a shared lock first: two processes upgrading at once must not wait on each
        other's shared locks."""
        self.unlock()
        return self._acquire(fcntl.LOCK_EX, on_wait)

    def try_exclusive(self) -> bool:
        return self._try(fcntl.LOCK_EX)

    def held_exclusively_elsewhere(self) -> bool:
        """Whether another process is compiling into the entry now."""
        if self._try(fcntl.LOCK_SH):
            self.unlock()
            return False
        return True

    def owner(self) -> str:
        """What the process that last compiled into the entry wrote: its pid, host, start."""
        try:
            return self.path.read_text().strip() or "another kiln process"
        except OSError:
            return "another kiln process"

    def unlock(self) -> None:
        if self.file is not None and self.mode is not None and not self.unsupported:
            fcntl.flock(self.file, fcntl.LOCK_UN)
        self.mode = None

    def release(self) -> None:
        """Unlock and close (also what the kernel does for a process that dies)."""
        self.unlock()
        if self.file is not None:
            self.file.close()
            self.file = None

    def _acquire(self, mode: int, on_wait: Callable[[str], None] | None) -> float:
        if self._try(mode):
            return 0.0
        t0 = time.monotonic()
        if on_wait is not None:
            on_wait(self.owner())
        while not self._try(mode):
            time.sleep(POLL_S)
        return time.monotonic() - t0

    def _try(self, mode: int) -> bool:
        try:
            if not self.unsupported:
                fcntl.flock(self._open_file(), mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            logger.warning(
                "cannot lock %s (%s): kiln processes that compile the same configuration at "
                "once may race on this cache; put KILN_CACHE_DIR on a local filesystem",
                self.path,
                exc.strerror,
            )
            self.unsupported = True
        self.mode = mode
        return True

    def record_owner(self) -> None:
        """Say who compiles into the entry, for the processes that wait on it (they read it
        unlocked: one short write). Called holding the lock exclusively."""
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        f = self._open_file()
        if not self.writable:
            return
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n")
        f.flush()

    def _open_file(self) -> IO[str]:
        if self.file is None:
            raise RuntimeError(f"the lock {self.path} was released")
        return self.file
