"""Trial metrics and validity on recorded streams, against hand-computed values."""

from __future__ import annotations

import asyncio
import math

import pytest

from kiln.bench.client import OpenAIClient
from kiln.bench.trial import StreamRecord, invalid_reasons, percentile, trial_metrics

_STORY = (
    "the keeper climbed the stairs at dusk and lit the lamp while gulls wheeled over a "
    "grey sea that had swallowed three ships in as many winters "
)
PROSE = _STORY.split()


def _record(**kw) -> StreamRecord:
    # 5 text chunks at 1.0, 1.1, 1.3, 1.4, 2.0 s after a send at 0.0 s
    times = [1.0, 1.1, 1.3, 1.4, 2.0]
    chunks = kw.pop("chunks", [(t, f" {w}") for t, w in zip(times, PROSE)])
    base = dict(
        start=0.0,
        chunks=chunks,
        prompt_tokens=1000,
        completion_tokens=5,
        cached_tokens=0,
        expected_output_tokens=5,
        target_prompt_tokens=1024,
        tolerance_percent=11.0,
    )
    return StreamRecord(**{**base, **kw})


def test_metrics_by_hand():
    m = trial_metrics(_record())
    assert m.ttft == 1.0 and m.e2e == 2.0
    assert m.prefill_tok_s == 1000.0  # 1000 prompt tokens / 1.0 s
    assert math.isclose(m.generation_tok_s, 4 / 1.0)  # 4 tokens after the first, in 1.0 s
    assert math.isclose(m.tpot, (2.0 - 1.0) / 4)
    assert [round(x, 6) for x in m.itl] == [0.1, 0.2, 0.1, 0.6]
    assert math.isclose(m.mean_itl, 0.25)
    p = m.itl_percentiles()
    assert math.isclose(p["p50"], 0.15)  # between 0.1 and 0.2
    assert math.isclose(p["p90"], 0.2 + 0.7 * 0.4)  # rank 2.7 of [0.1, 0.1, 0.2, 0.6]


def test_percentile_edges():
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))
    assert percentile([1, 2, 3, 4, 5], 50) == 3


def test_valid_trial_has_no_reasons():
    assert invalid_reasons(_record()) == []


@pytest.mark.parametrize(
    "changes,reason",
    [
        ({"error": "HTTP 500"}, "request_failed"),
        ({"completion_tokens": 4}, "output_length_mismatch"),
        ({"prompt_tokens": None}, "prompt_tokens_not_reported"),
        ({"prompt_tokens": 900}, "prompt_tokens_outside_tolerance"),  # 12.1% below 1024
        ({"cached_tokens": 16}, "prompt_cache_hit"),
        ({"chunks": [(1.0, " hello")]}, "too_few_text_tokens"),
        (
            {
                "chunks": [(1.0 + i / 10, " the") for i in range(40)],
                "completion_tokens": 40,
                "expected_output_tokens": 40,
            },
            "low_unique_token_ratio",
        ),
        (
            {
                "chunks": [(1.0 + i / 10, " the" if i % 4 else " sea") for i in range(40)],
                "completion_tokens": 40,
                "expected_output_tokens": 40,
            },
            "one_token_dominates",
        ),
        (
            {
                "chunks": [(1.0 + i / 100, " lamp keeper") for i in range(100)],
                "completion_tokens": 200,
                "expected_output_tokens": 200,
            },
            "highly_compressible_repetition",
        ),
        (
            {
                "chunks": [(1.0, " ".join(PROSE[:10])), (2.0, " ".join(PROSE[10:20]))],
                "completion_tokens": 20,
                "expected_output_tokens": 20,
            },
            "stream_not_incremental",
        ),
    ],
)
def test_each_invalid_reason(changes, reason):
    reasons = invalid_reasons(_record(**changes))
    assert reason in reasons


def test_tolerance_boundary():
    assert "prompt_tokens_outside_tolerance" not in invalid_reasons(_record(prompt_tokens=912))
    assert "prompt_tokens_outside_tolerance" in invalid_reasons(_record(prompt_tokens=911))


def test_a_timed_request_holds_eos_back_on_every_server():
    """ignore_eos for vLLM, llama.cpp's server and kiln; min_tokens for llama-cpp-python's
    server, which drops ignore_eos (its short outputs made every llama.cpp row invalid)."""
    client = OpenAIClient("http://127.0.0.1:9", "m")
    timed = client.chat_body([{"role": "user", "content": "hi"}], 128, True, stream=True)
    assert timed["ignore_eos"] is True and timed["min_tokens"] == timed["max_tokens"] == 128
    probe = client.chat_body([{"role": "user", "content": "hi"}], 16, False, stream=False)
    assert "ignore_eos" not in probe and "min_tokens" not in probe  # probes stop on their own


def test_random_weights_skip_the_text_checks_not_the_others():
    """A random-weight model repeats one token by design: without text checks that trial counts,
    while its length and streaming are still checked."""
    repeated = [(1.0 + i / 100, " lamp") for i in range(100)]
    rec = _record(chunks=repeated, completion_tokens=100, expected_output_tokens=100)
    assert {"one_token_dominates", "highly_compressible_repetition"} <= set(invalid_reasons(rec))
    assert invalid_reasons(rec, text_checks=False) == []
    short = _record(chunks=repeated, completion_tokens=100, expected_output_tokens=128)
    assert invalid_reasons(short, text_checks=False) == ["output_length_mismatch"]
    assert invalid_reasons(_record(chunks=[(1.0, " x")]), text_checks=False) == [
        "too_few_text_tokens"
    ]


def test_a_stream_that_stops_sending_fails_with_the_read_timeout_named():
    """A server that answers its headers and then nothing: the streamed request ends after the
    client's read timeout, with an error naming it (a trial then records it as failed)."""

    async def stalled(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        writer.write(b"transfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(30)  # never sends a byte of the body

    async def run():
        server = await asyncio.start_server(stalled, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = OpenAIClient(f"http://127.0.0.1:{port}", "m", timeout=0.5)
        try:
            return await client.stream_chat([{"role": "user", "content": "hi"}], 4)
        finally:
            await client.aclose()
            server.close()

    result = asyncio.run(run())
    assert result.error is not None and result.error.startswith("ReadTimeout")
    assert result.chunks == []
