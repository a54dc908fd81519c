"""A small OpenAI-compatible client for benchmarking: streamed chat completions timed on the
client's monotonic clock, plain completions for probes, and the optional endpoints servers
offer for token counting. Works against kiln, vLLM and llama.cpp servers."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kiln.errors import KilnError


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
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=30),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024),
        )

    async def aclose(self) -> None:
        await self.http.aclose()

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
            async with self.http.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:300]
                    result.error = f"HTTP {resp.status_code}: {detail}"
                    return result
                async for line in resp.aiter_lines():
                    _take_sse_line(line, result)
        except httpx.ReadTimeout as exc:
            result.error = (
                f"ReadTimeout: {exc or 'no byte'} within the read timeout "
                "(a long prefill? raise --request-timeout)"
            )
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        return result

    async def chat(self, messages: list[dict], max_tokens: int) -> tuple[str, dict[str, Any]]:
        body = self.chat_body(messages, max_tokens, ignore_eos=False, stream=False)
        data = await self._post_json("/v1/chat/completions", body)
        return data["choices"][0]["message"].get("content") or "", data.get("usage") or {}

    async def get_json(self, path: str) -> dict[str, Any] | None:
        """GET an optional endpoint; None when the server does not have it."""
        try:
            resp = await self.http.get(path)
        except httpx.HTTPError as exc:
            raise BenchError(f"cannot reach {self.base_url}{path}: {exc}") from None
        return resp.json() if resp.status_code == 200 else None

    async def try_post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            resp = await self.http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise BenchError(f"cannot reach {self.base_url}{path}: {exc}") from None
        return resp.json() if resp.status_code == 200 else None

    async def _post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            resp = await self.http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise BenchError(f"cannot reach {self.base_url}{path}: {exc}") from None
        if resp.status_code != 200:
            raise BenchError(f"{path} answered HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json()


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
