"""Boot phases, each timed and watched: a phase that runs past its limit is logged at ERROR
with the phase's name and where the booting thread is, then interrupted: a boot that hangs says
in which phase and where. The server boots on its engine thread, so the interruption
reaches whichever thread runs the phase."""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from kiln.errors import KilnError

logger = logging.getLogger(__name__)


class BootTimeoutError(KilnError):
    """A boot phase ran past --boot-timeout."""


class BootPhases:
    """Runs boot phases one after another; `durations` holds each one's seconds."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.durations: dict[str, float] = {}
        self.current: str | None = None
        self._lock = threading.Lock()
        self._count = 0  # phases started: a timer belongs to one of them, whatever its name
        self._expired: int | None = None
        self._owner = threading.get_ident()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        logger.info("boot: %s", name.replace("_", " "))
        start = time.monotonic()
        with self._lock:
            self._count += 1
            token, self.current, self._owner = self._count, name, threading.get_ident()
        timer = None
        if self.timeout_s:
            timer = threading.Timer(self.timeout_s, self._expire, args=(name, token))
            timer.daemon = True
            timer.start()
        try:
            yield
        except KeyboardInterrupt:
            if self._expired != token:
                raise
            raise BootTimeoutError(self._message(name)) from None
        finally:
            if timer is not None:
                timer.cancel()
            with self._lock:
                self.current = None
            self.durations[name] = time.monotonic() - start

    def _expire(self, name: str, token: int) -> None:
        with self._lock:
            if self.current is None or self._count != token:
                return  # the phase ended as the timer fired
            self._expired = token
        frame = sys._current_frames().get(self._owner)
        stack = "".join(traceback.format_stack(frame)) if frame else "(thread gone)\n"
        logger.error("%s; the booting thread is at:\n%s", self._message(name), stack)
        interrupt(self._owner)

    def _message(self, name: str) -> str:
        return (
            f"boot phase '{name}' did not finish within {self.timeout_s:g} s. Remedy: raise "
            "--boot-timeout (0 turns the limit off) if it is only slow; if it hangs, the "
            "stack logged with this message shows where"
        )


def interrupt(thread_id: int) -> None:
    """Raise KeyboardInterrupt in a thread at its next Python instruction (a C call it is
    inside finishes first). An asynchronous exception for every thread, the main one too:
    `_thread.interrupt_main` does nothing where SIGINT is ignored (a process started in the
    background by a non-interactive shell, or under nohup) and calls whatever Python handler
    is installed otherwise."""
    set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)
    if set_async_exc(thread_id, KeyboardInterrupt) != 1:
        logger.error("could not interrupt the booting thread (it has ended)")
