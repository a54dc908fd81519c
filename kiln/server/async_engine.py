"""The engine loop on its own thread, and an asyncio face for request handlers.

The engine is synchronous and owns its state; only the loop thread touches it, from boot on.
Booting it there matters on the CPU: OpenMP (libgomp) keeps a worker team per thread that ran
parallel work, and once more worker threads exist than cores it stops spinning between parallel
regions; a decode step of the embedded model ran 20% (eager) to 45% (compiled) slower on a
thread other than the one that booted the engine. Handlers
tokenize and validate in their own thread (`prepare_prompt` reads no engine state), then hand
the request over through an inbox; outputs come back on a per-request asyncio queue."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kiln.boot.phases import interrupt
from kiln.engine.llm_engine import LLMEngine
from kiln.errors import KilnError
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineOverloaded(KilnError):
    """The waiting queue is full; retry later."""


class EngineStopped(KilnError):
    """The server is shutting down."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """Boots the engine with `build_engine` on the loop thread; the constructor returns once
    it is up, or raises what the boot raised."""

    def __init__(
        self, build_engine: Callable[[], LLMEngine], max_waiting_requests: int = 256
    ) -> None:
        self.engine: LLMEngine
        self.max_waiting_requests = max_waiting_requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._pending = 0  # handed over but not yet scheduled
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._ids = itertools.count()
        self.on_output = None  # optional callback(RequestOutput) for metrics
        self._boot_error: BaseException | None = None
        booted = threading.Event()
        self._thread = threading.Thread(
            target=self._boot_then_loop,
            args=(build_engine, booted),
            name="kiln-engine",
            daemon=True,
        )
        try:
            self._thread.start()
            # woken often: a Ctrl-C that lands on another thread, or a simulated one, is only
            # handled when the main thread runs Python code
            while not booted.wait(0.1):
                pass
        except KeyboardInterrupt:  # Ctrl-C during boot: stop the boot too, not only the wait
            if self._thread.ident is not None:
                interrupt(self._thread.ident)
                self._thread.join(timeout=30)
            raise
        if self._boot_error is not None:
            raise self._boot_error

    # ---- the loop thread ----------------------------------------------------------------

    def _boot_then_loop(self, build_engine: Callable[[], LLMEngine], booted: threading.Event):
        try:
            self.engine = build_engine()
        except BaseException as exc:  # the constructor re-raises it on the caller's thread
            self._boot_error = exc
            return
        finally:
            booted.set()
        self._loop()

    def _loop(self) -> None:
        while True:
            self._drain_inbox()
            if not self.engine.has_unfinished_requests():
                if self._stopping and self._inbox.empty():
                    return
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # an engine bug must not hang every client
                logger.exception("engine step failed")
                self._fail_all(exc)
                continue
            self._deliver_all(outputs)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request_id, text, ids, params, arrival = payload
                with self._lock:
                    self._pending -= 1
                # added even when its client is already gone: the abort posted behind it in
                # the inbox ends it before any step, and counts it as aborted
                self.engine.add_prepared(request_id, text, ids, params, arrival)
            elif kind == "abort":
                out = self.engine.abort_request(payload)
                if out is not None:  # its stream, if still open, ends on it
                    self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        self._deliver_all([out])

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs in one wake-up of each event loop that waits on them: a wake-up
        per output (64 a step at 64 streams) made the loop thread and the engine thread trade
        the GIL at every one."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for out in outputs:
            if self.on_output is not None:
                self.on_output(out)
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, exc: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)

    # ---- handler side ---------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self._pending + len(self.engine.scheduler.waiting)

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{int(time.time() * 1000)}"

    def admit(self, count: int) -> None:
        """Take `count` prompts in, or refuse them all: while the server drains
        (EngineStopped), or while the waiting queue is at its bound (EngineOverloaded). The
        bound is checked once for all of them, so that one HTTP request is admitted whole or
        not at all, and a request larger than the bound is admitted once the queue is short."""
        if self._stopping:
            raise EngineStopped("the server is shutting down")
        with self._lock:
            if self.num_waiting >= self.max_waiting_requests:
                raise EngineOverloaded(
                    f"{self.num_waiting} requests are waiting (limit {self.max_waiting_requests})"
                )
            self._pending += count

    def generate(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        admitted: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Hand the request to the engine now, and return its outputs as a stream; a consumer
        that stops early (a disconnect) aborts the request, and so does `abort`, for a stream
        nobody started. `admitted`: the caller has taken the prompt in with `admit`."""
        if not admitted:
            self.admit(1)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._inbox.put(("add", (request_id, text, ids, params, time.monotonic())))
        self._wake.set()
        return self._outputs(request_id, stream)

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request whose client is gone: nobody reads its stream any more."""
        self._streams.pop(request_id, None)
        self._post_abort(request_id)

    def _post_abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def refuse_new(self) -> None:
        """From now on new requests get EngineStopped (a 503); running ones go on."""
        self._stopping = True
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        """Finish what is running (new requests are refused), then end the loop thread."""
        self.refuse_new()
        self._thread.join(timeout)

    def abort_all(self) -> None:
        """Abort every request a client waits on: each stream ends with its output so far and
        finish_reason "abort"."""
        for request_id in list(self._streams):
            self._post_abort(request_id)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)
