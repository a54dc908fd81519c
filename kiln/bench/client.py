"""A small OpenAI-compatible client for benchmarking: streamed chat completions timed on the
client's monotonic clock, plain completions for probes, and the optional endpoints servers
offer for token counting. Works against kiln, vLLM and llama.cpp servers.

On aiohttp rather than httpx: the load generator shares the machine with the server it
measures, and at 64 streams httpx's pure-Python HTTP parsing took about a second of CPU per
round of 8,192 streamed tokens, time the server's threads then lost."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kiln.errors import KilnError


def run_client(main: Coroutine[Any, Any, Any]) -> Any:
    """`asyncio.run`, on uvloop where it is installed (as the server's loop): its loop spends
    less CPU per event, which the load generator takes from the server it measures."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


class BenchError(KilnError):
    """A benchmark cannot go on (server unreachable, prompt size impossible, ...)."""


@dataclass
class StreamResult:
    start: float
    chunks: list[tuple[float, str]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.chunks)


class OpenAIClient:
    def __init__(
        self, base_url: str, model: str, api_key: str | None = None, timeout: float = 600
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # `timeout`: how long a response may go without a byte, not the whole response
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout)
        self._session: aiohttp.ClientSession | None = None

    @property
    def http(self) -> aiohttp.ClientSession:
        """Made on first use: a session belongs to the event loop that is running then."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self.headers,
                timeout=self.timeout,
                connector=aiohttp.TCPConnector(limit=1024),
                trust_env=True,  # HTTP(S)_PROXY and NO_PROXY, as httpx and curl read them
                read_bufsize=1 << 20,  # one event of a stream is one line; logprobs make it long
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def chat_body(
        self, messages: list[dict], max_tokens: int, ignore_eos: bool, stream: bool
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if ignore_eos:
            # vLLM, llama.cpp's own server and kiln read ignore_eos; llama-cpp-python's server
            # drops it and reads min_tokens (so do vLLM and kiln), which holds EOS back as well
            body["ignore_eos"] = True
            body["min_tokens"] = max_tokens
        return body

    async def stream_chat(
        self, messages: list[dict], max_tokens: int, ignore_eos: bool = True
    ) -> StreamResult:
        """One streamed request; errors are recorded on the result, never raised."""
        body = self.chat_body(messages, max_tokens, ignore_eos, stream=True)
        result = StreamResult(start=time.monotonic())
        try:
            async with self.http.post(self.base_url + "/v1/chat/completions", json=body) as resp:
                if resp.status != 200:
                    detail = (await resp.read()).decode(errors="replace")[:300]
                    result.error = f"HTTP {resp.status}: {detail}"
                    return result
                async for line in resp.content:
                    _take_sse_line(line.decode(), result)
        except (aiohttp.ServerTimeoutError, TimeoutError) as exc:
            result.error = (
                f"ReadTimeout: {exc or 'no byte'} within the read timeout "
                "(a long prefill? raise --request-timeout)"
            )
        except (aiohttp.ClientError, ValueError) as exc:  # ValueError: a line past the buffer
            result.error = f"{type(exc).__name__}: {exc}"
        return result

    async def chat(self, messages: list[dict], max_tokens: int) -> tuple[str, dict[str, Any]]:
        body = self.chat_body(messages, max_tokens, ignore_eos=False, stream=False)
        data = await self._post_json("/v1/chat/completions", body)
        return data["choices"][0]["message"].get("content") or "", data.get("usage") or {}

    async def get_json(self, path: str) -> dict[str, Any] | None:
        """GET an optional endpoint; None when the server does not have it."""
        return await self._request("GET", path, None, optional=True)

    async def try_post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        return await self._request("POST", path, body, optional=True)

    async def _post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._request("POST", path, body, optional=False)

    async def _request(
        self, method: str, path: str, body: dict[str, Any] | None, optional: bool
    ) -> Any:
        """The JSON answer; None for an optional endpoint that does not answer 200."""
        try:
            async with self.http.request(method, self.base_url + path, json=body) as resp:
                raw = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BenchError(
                f"cannot reach {self.base_url}{path}: {exc or type(exc).__name__}"
            ) from None
        if resp.status != 200:
            if optional:
                return None
            text = raw.decode(errors="replace")[:300]
            raise BenchError(f"{path} answered HTTP {resp.status}: {text}")
        try:
            return json.loads(raw)
        except ValueError:
            raise BenchError(
                f"{path} answered 200 with a body that is not JSON: {raw[:100]!r}"
            ) from None


def _take_sse_line(line: str, result: StreamResult) -> None:
    if not line.startswith("data:"):
        return
    payload = line[5:].strip()
    if payload == "[DONE]":
        return
    now = time.monotonic()
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        result.error = f"malformed stream event: {payload[:100]}"
        return
    if "error" in event:
        result.error = str(event["error"])[:300]
        return
    if event.get("usage"):
        result.usage = event["usage"]
    for choice in event.get("choices") or []:
        text = (choice.get("delta") or {}).get("content")
        if text:
            result.chunks.append((now, text))
