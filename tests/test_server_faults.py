"""The server under faults, against a real `kiln serve` with the embedded model: clients that go
away stop their requests (one-shot ones too), a disconnect is no error in the log, a shutdown
ends the answers still in flight cleanly, and every response is counted by route and status."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import pytest

from tests.server_helpers import ServerProcess

LONG = {"prompt": "Tell me a very long story.", "max_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--kv-cache-memory", "512MiB", "--max-num-seqs", "16")
    yield srv
    srv.stop()


def _engine(base: str) -> dict:
    return httpx.get(base + "/v1/engine", timeout=30).json()


def _until_idle(base: str, timeout: float = 30) -> dict:
    """/v1/engine once nothing runs; an abort lands within a step or two, far sooner than the
    timeout (a 1500-token answer takes minutes here)."""
    end = time.monotonic() + timeout
    info = _engine(base)
    while info["stats"]["num_running"] and time.monotonic() < end:
        time.sleep(0.1)  # polling a condition, bounded by the timeout
        info = _engine(base)
    return info


def _metric(base: str, name: str, **labels: str) -> float:
    text = httpx.get(base + "/metrics", timeout=30).text
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _log(srv: ServerProcess) -> str:
    with open(srv.server.log_path, errors="replace") as f:
        return f.read()


def test_a_one_shot_request_stops_when_its_client_leaves(server):
    aborted = _metric(server.base, "kiln_requests_total", status="aborted")
    left = _metric(server.base, "kiln_http_requests_total", handler="/v1/completions",
                   method="POST", status="499")  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", json={**LONG, "n": 2}, timeout=3)
    info = _until_idle(server.base)
    assert info["stats"]["num_running"] == 0
    assert info["num_free_blocks"] == info["num_blocks"]
    assert _metric(server.base, "kiln_requests_total", status="aborted") == aborted + 1
    assert _metric(server.base, "kiln_http_requests_total", handler="/v1/completions",
                   method="POST", status="499") == left + 1  # fmt: skip


def test_a_stream_whose_client_leaves_stops_and_logs_no_error(server):
    body = {**LONG, "n": 2, "stream": True}
    for _ in range(3):
        with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert any(next(lines).startswith("data:") for _ in range(4))
    info = _until_idle(server.base)
    assert info["stats"]["num_running"] == 0
    assert info["num_free_blocks"] == info["num_blocks"]
    log = _log(server)
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


def test_every_response_is_counted_by_route_and_status(server):
    def count(handler: str, method: str, status: str) -> float:
        return _metric(server.base, "kiln_http_requests_total", handler=handler, method=method,
                       status=status)  # fmt: skip

    before = [
        count("/v1/completions", "POST", "400"),
        count("/v1/completions", "GET", "405"),
        count("(unmatched)", "GET", "404"),
        count("/tokenize", "POST", "200"),
    ]
    bad = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "top_p": 5})
    assert bad.status_code == 400
    wrong_method = httpx.get(server.base + "/v1/completions")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert httpx.get(server.base + "/no/such/path").status_code == 404
    assert httpx.post(server.base + "/tokenize", json={"prompt": "hi"}).status_code == 200
    after = [
        count("/v1/completions", "POST", "400"),
        count("/v1/completions", "GET", "405"),
        count("(unmatched)", "GET", "404"),
        count("/tokenize", "POST", "200"),
    ]
    assert after == [b + 1 for b in before]


def test_the_openapi_document_states_what_the_server_answers(server):
    doc = httpx.get(server.base + "/openapi.json").json()
    ops = {(p, m): op for p, item in doc["paths"].items() for m, op in item.items()}
    text = json.dumps(doc)
    assert '"422"' not in text and not re.search(r'"(ge|le|gt|lt)":', text)
    completions = ops[("/v1/completions", "post")]["responses"]
    assert set(completions) == {"200", "400", "404", "413", "500", "503"}  # no key: no 401
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "Retry-After" in completions["503"]["headers"]
    assert set(ops[("/metrics", "get")]["responses"]["200"]["content"]) == {"text/plain"}
    request = doc["components"]["schemas"]["CompletionRequest"]
    assert request["properties"]["prompt"]["anyOf"][0]["minLength"] == 1
    vocab = _engine(server.base)["model_config"]["vocab_size"]
    assert request["properties"]["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == vocab - 1
    tokenize = doc["components"]["schemas"]["TokenizeRequest"]
    assert tokenize["allOf"][0]["anyOf"][0]["required"] == ["prompt"]


def test_shutdown_ends_answers_in_flight_with_a_last_chunk():
    srv = ServerProcess("--kv-cache-memory", "512MiB", "--shutdown-timeout", "2")
    try:
        lines: list[str] = []
        one_shot: list[dict] = []
        started = threading.Event()

        def stream() -> None:
            body = {**LONG, "stream": True}
            with httpx.stream("POST", srv.base + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        started.set()
                        lines.append(line)

        def wait_whole() -> None:
            one_shot.append(httpx.post(srv.base + "/v1/completions", json=LONG, timeout=120).json())

        readers = [threading.Thread(target=stream), threading.Thread(target=wait_whole)]
        for t in readers:
            t.start()
        assert started.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        for t in readers:
            t.join(120)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][5:])["choices"][0]["finish_reason"] == "abort"
        assert one_shot[0]["choices"][0]["finish_reason"] == "abort"
        assert srv.proc.wait(60) == 0
        log = _log(srv)
        assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    finally:
        srv.stop()


def test_a_request_aborted_before_the_engine_took_it_is_counted(tiny_models):
    """A client that leaves while its request still waits in the engine's inbox: the request
    ends as aborted, so every admitted request is counted once (the soak test found requests
    that were admitted, never added and never counted)."""
    import asyncio

    from kiln.sampling_params import SamplingParams
    from kiln.server.async_engine import AsyncEngine
    from tests.helpers import make_engine

    engine = AsyncEngine(lambda: make_engine(tiny_models["llama"]))
    hold, held, finished = threading.Event(), threading.Event(), []

    def on_output(out) -> None:  # runs on the engine's thread: hold it once, mid-step
        if not held.is_set():
            held.set()
            hold.wait(30)
        if out.finished:
            finished.append((out.request_id, out.outputs[0].finish_reason))

    engine.on_output = on_output
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    async def scenario() -> None:
        first = engine.generate("first", None, [5, 6, 7], params)
        pump = asyncio.create_task(anext(first))
        await asyncio.to_thread(held.wait, 30)  # the engine thread is inside on_output now
        engine.generate("gone", None, [8, 9], params)
        engine.abort("gone")  # both the add and the abort wait in the inbox
        hold.set()
        await pump
        async for _ in first:
            pass

    try:
        asyncio.run(scenario())
        end = time.monotonic() + 30
        while len(finished) < 2 and time.monotonic() < end:
            time.sleep(0.05)  # polling a condition, bounded
    finally:
        engine.stop(timeout=30)
    assert sorted(finished) == [("first", "length"), ("gone", "abort")]
