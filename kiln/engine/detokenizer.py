"""Incremental detokenization with stop strings.

`tokenizers.decoders.DecodeStream` turns tokens into text as they come and withholds bytes of
an unfinished UTF-8 character. On top, text that could be the start of a stop string is held
back while streaming, so a stop string never reaches the client."""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(
        self,
        backend: Any,
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.backend = backend
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters of `text` already handed out

    def add_token(self, token_id: int, match_stop: bool = True) -> str | None:
        """Append one token; return the stop string if the text now contains one (looked for
        only when `match_stop`: before min_tokens a stop string does not count)."""
        piece = self.stream.step(self.backend, token_id)
        if not piece or not match_stop:
            self.text += piece or ""
            return None
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        for stop in self.stop:
            at = self.text.find(stop, start)
            if at != -1:
                self.text = self.text[: at + len(stop) if self.include_stop else at]
                return stop
        return None

    def take_delta(self, final: bool) -> str:
        """New text safe to emit; everything left when the sequence is final."""
        end = (
            len(self.text)
            if final or not self.stop
            else max(self.emitted, len(self.text) - self.hold)
        )
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
