"""From engine output streams to HTTP bodies: the final JSON of a one-shot request (watching
for a client that goes away) and the server-sent events of a streamed one. A client that
goes away aborts its requests, one-shot or streamed; that is normal operation, not an error."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kiln.outputs import RequestOutput
from kiln.server.errors import APIError
from kiln.server.responses import ResponseBuilder

CLIENT_CLOSED = 499  # nginx's code for a client that closed the connection before the answer


async def first_items(streams) -> list[RequestOutput | None]:
    """Start every stream (admission errors surface here, as HTTP errors)."""
    firsts = []
    for s in streams:
        try:
            firsts.append(await s.__anext__())
        except StopAsyncIteration:
            firsts.append(None)
        except BaseException:
            for other in streams:
                await other.aclose()
            raise
    return firsts


async def _last(stream) -> RequestOutput:
    out = None
    async for out in stream:  # noqa: B007 - the last output is the final one
        pass
    return out


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the request's body has been read by then, so the
    next message on the channel is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(request: Request, streams, builder: ResponseBuilder) -> dict:
    """The final JSON of every stream. If the client goes away first, or a stream fails, the
    other streams' consumers are cancelled (which aborts their requests) before this returns."""
    tasks = [asyncio.ensure_future(_last(s)) for s in streams]
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        pending = set(tasks)
        while pending:
            done, _ = await asyncio.wait([*pending, gone], return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                raise APIError(CLIENT_CLOSED, "client disconnected", "ClientDisconnected")
            for task in done:
                pending.discard(task)
                task.result()  # a stream's error ends the request here
        return builder.final([t.result() for t in tasks])
    finally:
        gone.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class AbortingStream(StreamingResponse):
    """A streamed response that aborts its requests when it ends for any reason (a client that
    disconnects before the first chunk included): `on_close` runs whatever happened."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _merged(streams, firsts) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every stream's outputs as (stream index, output), in the order they come. One stream
    (the usual request) is read as it is: a pump task and a queue per output cost the event
    loop a task switch per token, at every stream. Streams of an abandoned response end
    through its `on_close`, which aborts their requests."""
    if len(streams) == 1:
        if firsts[0] is not None:
            yield 0, firsts[0]
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream, first) -> None:
        try:
            if first is not None:
                await queue.put((i, first))
            async for out in stream:
                await queue.put((i, out))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
    done = 0
    try:
        while done < len(tasks):
            i, out = await queue.get()
            if out is None:
                done += 1
            else:
                yield i, out
    finally:
        # Cancelled pumps end their streams themselves (a stream aborts its request when its
        # consumer is cancelled); awaiting or closing the streams here, while the pumps still
        # iterate them or while this generator is being cancelled, would fail.
        for t in tasks:
            t.cancel()


async def sse(builder: ResponseBuilder, streams, firsts, body) -> AsyncIterator[str]:
    finals: dict[int, RequestOutput] = {}
    sent_role: set[int] = set()
    lp_sent: dict[int, int] = {}
    # closed with this generator, so that an abandoned response cancels its pumps at once
    async with aclosing(_merged(streams, firsts)) as merged:
        async for i, out in merged:
            if out.finished:
                finals[i] = out
            for c in out.outputs:
                if not (c.delta_text or c.finished or c.delta_token_ids):
                    continue
                index = i * body.n + c.index
                chunk = builder.chunk(index, c, index not in sent_role, lp_sent.get(index, 0))
                sent_role.add(index)
                lp_sent[index] = len(c.logprobs or [])
                if body.include_usage:
                    chunk["usage"] = None
                yield f"data: {json.dumps(chunk)}\n\n"
    if body.include_usage:
        yield f"data: {json.dumps(builder.usage_chunk(list(finals.values())))}\n\n"
    yield "data: [DONE]\n\n"
