"""Prompt-lookup drafts: find the latest earlier place where the sequence's last tokens occurred
and propose the tokens that followed them there. Free to compute, and right often wherever an
answer repeats its context (code edits, quotes, structured output)."""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
    `token_ids` of `min_n` to `max_n` tokens; [] when no suffix of `min_n` tokens recurs."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    size = tokens.size
    if size < min_n + 1 or k < 1:
        return []
    # where earlier copies of the suffix end, each with a continuation after it
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    matched = 1
    for offset in range(1, min(max_n, size)):
        earlier = ends[ends >= offset]
        longer = earlier[tokens[earlier - offset] == tokens[-1 - offset]]
        if longer.size == 0:
            break
        ends, matched = longer, offset + 1
    if ends.size == 0 or matched < min_n:
        return []
    # the latest copy with k tokens after it (the nearest context), else the earliest
    full = ends[ends <= size - 1 - k]
    start = int(full[-1] if full.size else ends[0]) + 1
    return tokens[start : start + k].tolist()
