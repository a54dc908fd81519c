"""OpenAI response shapes built from kiln's outputs."""

from __future__ import annotations

import time
from typing import Any

from kiln.outputs import CompletionOutput, Logprobs, RequestOutput


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def usage_of(outs: list[RequestOutput]) -> dict[str, Any]:
    return usage(
        sum(o.num_prompt_tokens for o in outs),
        sum(o.num_completion_tokens for o in outs),
        sum(o.num_cached_tokens for o in outs),
    )


def _token_entry(t) -> dict[str, Any]:
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())}


def chat_logprobs(items: list[Logprobs] | None) -> dict[str, Any] | None:
    if items is None:
        return None
    return {
        "content": [
            {**_token_entry(lp.sampled), "top_logprobs": [_token_entry(t) for t in lp.top]}
            for lp in items
        ]
    }


def completion_logprobs(items: list[Logprobs] | None, offset: int = 0) -> dict[str, Any] | None:
    if items is None:
        return None
    tokens = [lp.sampled.token for lp in items]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.sampled.logprob for lp in items],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in items],
        "text_offset": offsets,
    }


class ResponseBuilder:
    def __init__(
        self, kind: str, request_id: str, model: str, n: int = 1, echo: list[str] | None = None
    ) -> None:
        """`echo`: per prompt, the text each of its `n` choices starts with (completions'
        `echo`); it goes in a choice's first chunk when streaming."""
        self.kind, self.id, self.model = kind, request_id, model
        self.n, self.echo = n, echo
        self.created = int(time.time())

    def _echoed(self, index: int, text: str) -> str:
        return self.echo[index // self.n] + text if self.echo else text

    def _envelope(self, obj: str, choices: list, usage_: dict | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_,
        }

    def final(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for p, out in enumerate(outs):
            for c in out.outputs:
                choices.append(self._choice(p * self.n + c.index, c))
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, choices, usage_of(outs))

    def _choice(self, index: int, c: CompletionOutput) -> dict[str, Any]:
        if self.kind == "chat":
            return {
                "index": index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        return {
            "index": index,
            "text": self._echoed(index, c.text),
            "logprobs": completion_logprobs(c.logprobs),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    def chunk(
        self, index: int, c: CompletionOutput, first: bool, logprobs_from: int
    ) -> dict[str, Any]:
        new_lp = None if c.logprobs is None else c.logprobs[logprobs_from:]
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": c.delta_text}
            if first:
                delta["role"] = "assistant"
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": chat_logprobs(new_lp),
                "finish_reason": c.finish_reason,
            }
            return self._envelope("chat.completion.chunk", [choice], None)
        choice = {
            "index": index,
            "text": self._echoed(index, c.delta_text) if first else c.delta_text,
            "logprobs": completion_logprobs(new_lp),
            "finish_reason": c.finish_reason,
        }
        return self._envelope("text_completion", [choice], None)

    def usage_chunk(self, outs: list[RequestOutput]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, [], usage_of(outs))
