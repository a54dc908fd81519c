"""From engine output streams to HTTP bodies: the final JSON of a one-shot request (watching
for a client that went away) and the server-sent events of a streamed one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request

from kiln.outputs import RequestOutput
from kiln.server.errors import APIError
from kiln.server.responses import ResponseBuilder


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


async def collect(request: Request, streams, builder: ResponseBuilder) -> dict:
    async def last(stream) -> RequestOutput:
        out = None
        async for out in stream:  # noqa: B007 - the last output is the final one
            pass
        return out

    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    while not all(t.done() for t in tasks):
        await asyncio.wait(tasks, timeout=0.5)
        if await request.is_disconnected():
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise APIError(499, "client disconnected", "ClientDisconnected")
    return builder.final([t.result() for t in tasks])


async def sse(builder: ResponseBuilder, streams, firsts, body) -> AsyncIterator[str]:
    queue: asyncio.Queue = asyncio.Queue()
    finals: dict[int, RequestOutput] = {}

    async def pump(i: int, stream, first) -> None:
        try:
            if first is not None:
                await queue.put((i, first))
            async for out in stream:
                await queue.put((i, out))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
    sent_role: set[int] = set()
    lp_sent: dict[int, int] = {}
    done = 0
    try:
        while done < len(tasks):
            i, out = await queue.get()
            if out is None:
                done += 1
                continue
            if out.finished:
                finals[i] = out
            for c in out.outputs:
                if not (c.delta_text or c.finished or c.delta_token_ids):
                    continue
                index = i * body.n + c.index
                chunk = builder.chunk(index, c, index not in sent_role, lp_sent.get(index, 0))
                sent_role.add(index)
                lp_sent[index] = len(c.logprobs or [])
                if chunk["choices"][0].get("finish_reason") == "abort":
                    chunk["choices"][0]["finish_reason"] = "stop"
                if body.include_usage:
                    chunk["usage"] = None
                yield f"data: {json.dumps(chunk)}\n\n"
        if body.include_usage:
            yield f"data: {json.dumps(builder.usage_chunk(list(finals.values())))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()
