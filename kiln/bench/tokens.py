"""Counting a chat prompt's tokens the way the server under test counts them.

In order of preference: the server's own `/tokenize` with `messages` (kiln, vLLM: exact,
template included); a local tokenizer the user names (`--tokenizer`, exact); a text-only
tokenize endpoint (llama.cpp's `/tokenize`, llama-cpp-python's `/extras/tokenize`) plus the chat
template's overhead, calibrated once from the server's own `usage` on a 1-token request."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kiln.bench.client import BenchError, OpenAIClient

Messages = list[dict[str, str]]


@dataclass
class TokenCounter:
    method: str  # how counts are made, for the report
    count_messages: Callable[[Messages], Awaitable[int]]

    async def count(self, messages: Messages) -> int:
        return await self.count_messages(messages)


async def make_counter(
    client: OpenAIClient, skeleton: Messages, tokenizer_path: str | None = None
) -> TokenCounter:
    """`skeleton`: messages shaped like the benchmark's, used to calibrate template overhead."""
    if tokenizer_path is not None:
        return _local_counter(tokenizer_path)
    probe = {"model": client.model, "messages": skeleton}
    data = await client.try_post_json("/tokenize", probe)
    if data is not None and ("count" in data or "tokens" in data):
        return TokenCounter("server /tokenize (messages)", _server_chat_counter(client))
    text_count = await _text_endpoint(client)
    if text_count is None:
        raise BenchError(
            f"{client.base_url} has no tokenize endpoint kiln knows; pass --tokenizer PATH "
            "(the model's .gguf file or HF directory) so prompt sizes can be counted"
        )
    name, count_text = text_count
    overhead = await _template_overhead(client, skeleton, count_text)

    async def count(messages: Messages) -> int:
        return overhead + sum([await count_text(m["content"]) for m in messages])

    return TokenCounter(f"server {name} + {overhead} template tokens", count)


def _server_chat_counter(client: OpenAIClient) -> Callable[[Messages], Awaitable[int]]:
    async def count(messages: Messages) -> int:
        data = await client.try_post_json(
            "/tokenize", {"model": client.model, "messages": messages}
        )
        if data is None:
            raise BenchError(f"{client.base_url}/tokenize stopped answering")
        return int(data["count"]) if "count" in data else len(data["tokens"])

    return count


async def _text_endpoint(client: OpenAIClient):
    """llama.cpp's server, then llama-cpp-python's."""
    candidates = [
        ("/tokenize", lambda t: {"content": t, "add_special": False}),
        ("/extras/tokenize", lambda t: {"input": t, "model": client.model}),
    ]
    for path, body in candidates:
        data = await client.try_post_json(path, body("hello world"))
        if data is not None and isinstance(data.get("tokens"), list):
            return path, _text_counter(client, path, body)
    return None


def _text_counter(client: OpenAIClient, path: str, body) -> Callable[[str], Awaitable[int]]:
    async def count(text: str) -> int:
        data = await client.try_post_json(path, body(text))
        if data is None:
            raise BenchError(f"{client.base_url}{path} stopped answering")
        return len(data["tokens"])

    return count


async def _template_overhead(client: OpenAIClient, skeleton: Messages, count_text) -> int:
    _, usage = await client.chat(skeleton, max_tokens=1)
    prompt_tokens = usage.get("prompt_tokens")
    if not prompt_tokens:
        raise BenchError(
            f"{client.base_url} reports no usage.prompt_tokens; pass --tokenizer PATH instead"
        )
    content = sum([await count_text(m["content"]) for m in skeleton])
    return int(prompt_tokens) - content


def _local_counter(path: str) -> TokenCounter:
    tokenizer = load_local_tokenizer(path)

    async def count(messages: Messages) -> int:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tokenizer.encode(text, add_special_tokens=False))

    return TokenCounter(f"local tokenizer of {path}", count)


def load_local_tokenizer(path: str):
    """HF transformers' tokenizer of a local HF directory or a GGUF file's metadata. Imported
    here, only for `--tokenizer`: transformers loads torch, which a benchmark client otherwise
    never needs."""
    from transformers import AutoTokenizer

    try:
        if path.endswith(".gguf"):
            folder, name = os.path.split(os.path.abspath(path))
            return AutoTokenizer.from_pretrained(folder, gguf_file=name)
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise BenchError(f"--tokenizer {path!r}: cannot load a tokenizer from it ({exc})") from None
