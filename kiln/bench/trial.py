"""One benchmark trial: the metrics of a recorded stream and whether the trial is valid.

Metrics follow vLLM's `bench serve`: TTFT is the time to the first chunk that carries text;
ITL the gaps between text chunks; TPOT (end-to-end - TTFT) / (completion tokens - 1).
Generation tok/s is (completion tokens - 1) / (time from first to last text chunk), so the
prefill does not dilute it. Token counts come from the server's `usage`."""

from __future__ import annotations

import collections
import statistics
import zlib
from dataclasses import dataclass, field

# validity thresholds (named so a report can print them)
MIN_TEXT_CHUNKS = 2
MIN_UNIQUE_WORD_RATIO = 0.1
MAX_TOP_WORD_SHARE = 0.5
MIN_COMPRESSION_RATIO = 0.08  # compressed / raw bytes; degenerate repetition compresses below
MIN_INCREMENTAL_SHARE = 0.5  # text chunks per completion token


@dataclass
class StreamRecord:
    start: float  # monotonic time the request was sent
    chunks: list[tuple[float, str]]  # (monotonic arrival, text) of chunks carrying text
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    expected_output_tokens: int
    target_prompt_tokens: int
    tolerance_percent: float
    error: str | None = None
    usage_source: str = "server"  # "client" where the stream carried no usage (llama.cpp)

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.chunks)


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class TrialMetrics:
    prompt_tokens: int | None
    completion_tokens: int | None
    ttft: float | None = None
    e2e: float | None = None
    prefill_tok_s: float | None = None
    generation_tok_s: float | None = None
    tpot: float | None = None
    itl: list[float] = field(default_factory=list)

    @property
    def mean_itl(self) -> float | None:
        return statistics.fmean(self.itl) if self.itl else None

    def itl_percentiles(self) -> dict[str, float]:
        return {f"p{p}": percentile(self.itl, p) for p in (50, 90, 99)}


def trial_metrics(rec: StreamRecord) -> TrialMetrics:
    m = TrialMetrics(rec.prompt_tokens, rec.completion_tokens)
    if not rec.chunks:
        return m
    first, last = rec.chunks[0][0], rec.chunks[-1][0]
    m.ttft, m.e2e = first - rec.start, last - rec.start
    m.itl = [b[0] - a[0] for a, b in zip(rec.chunks, rec.chunks[1:])]
    if rec.prompt_tokens and m.ttft > 0:
        m.prefill_tok_s = rec.prompt_tokens / m.ttft
    n = rec.completion_tokens
    if n and n > 1 and last > first:
        m.generation_tok_s = (n - 1) / (last - first)
        m.tpot = (m.e2e - m.ttft) / (n - 1)
    return m


def invalid_reasons(
    rec: StreamRecord, text_checks: bool = True, tokens_per_step: int = 1
) -> list[str]:
    """Named reasons this trial may not count; empty when valid. `text_checks` False (random
    weights) skips the checks of what the answer says, not of its length or streaming.
    `tokens_per_step`: the most tokens a step of the server emits in one chunk (1 + k with
    speculative decoding), which lowers the chunks per token a streaming server must reach."""
    if rec.error is not None:
        return ["request_failed"]
    reasons = []
    if rec.completion_tokens != rec.expected_output_tokens:
        reasons.append("output_length_mismatch")
    if rec.prompt_tokens is None:
        reasons.append("prompt_tokens_not_reported")
    else:
        off = abs(rec.prompt_tokens - rec.target_prompt_tokens) / rec.target_prompt_tokens * 100
        if off > rec.tolerance_percent:
            reasons.append("prompt_tokens_outside_tolerance")
    if rec.cached_tokens:
        reasons.append("prompt_cache_hit")
    reasons += _stream_reasons(rec, tokens_per_step)
    if text_checks and len(rec.chunks) >= MIN_TEXT_CHUNKS:
        reasons += _text_reasons(rec)
    return reasons


def _stream_reasons(rec: StreamRecord, tokens_per_step: int) -> list[str]:
    if len(rec.chunks) < MIN_TEXT_CHUNKS:
        return ["too_few_text_tokens"]
    share = MIN_INCREMENTAL_SHARE / tokens_per_step
    if rec.completion_tokens and len(rec.chunks) / rec.completion_tokens < share:
        return ["stream_not_incremental"]
    return []


def _text_reasons(rec: StreamRecord) -> list[str]:
    reasons = []
    words = rec.text.split()
    if words:
        if len(set(words)) / len(words) < MIN_UNIQUE_WORD_RATIO:
            reasons.append("low_unique_token_ratio")
        if collections.Counter(words).most_common(1)[0][1] / len(words) > MAX_TOP_WORD_SHARE:
            reasons.append("one_token_dominates")
    raw = rec.text.encode()
    if len(raw) >= 200 and len(zlib.compress(raw, 9)) / len(raw) < MIN_COMPRESSION_RATIO:
        reasons.append("highly_compressible_repetition")
    return reasons
