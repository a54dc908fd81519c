"""The OpenAI-compatible server, driven by the real `openai` client against a real `kiln serve`
process with the embedded model."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from kiln import SamplingParams
from tests.server_helpers import ServerProcess

KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--kv-cache-memory", "512MiB", "--max-num-seqs", "64", api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)


def _engine(server) -> dict:
    return httpx.get(server.base + "/v1/engine", headers={"Authorization": f"Bearer {KEY}"}).json()


def test_open_endpoints(server):
    assert httpx.get(server.base + "/health").status_code == 200
    assert "version" in httpx.get(server.base + "/version").json()
    metrics = httpx.get(server.base + "/metrics").text
    for name in (
        "kiln_requests_total",
        "kiln_time_to_first_token_seconds",
        "kiln_steps_total",
        "kiln_graph_misses_total",
        "kiln_kv_cache_usage_ratio",
        "kiln_prefix_cache_hit_rate",
        "kiln_num_preemptions_total",
    ):
        assert name in metrics


def test_models_and_engine(client, server):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.owned_by == "kiln"
    assert model.max_model_len == 8192 and model.root.endswith(".gguf")
    info = _engine(server)
    assert info["graph_plan"]["cudagraph_mode"] == "NONE" and info["max_model_len"] == 8192
    assert info["compile_cache"] is None and info["compilation"] is None  # mode 0


def test_chat_and_completion(client):
    chat = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=24,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        response_format={"type": "text"},  # the default: accepted
    )
    assert "Paris" in chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage.completion_tokens == 8 and chat.usage.prompt_tokens == 37
    parts = [{"type": "text", "text": t} for t in ("What is the capital ", "of France?")]
    as_parts = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=24, messages=[{"role": "user", "content": parts}]
    )
    assert as_parts.choices[0].message.content == chat.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="1 + 1 =", temperature=0, max_tokens=4)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 4


def test_greedy_matches_the_offline_api(client, smollm_llm):
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    offline = smollm_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    for prompt, ref in zip(prompts, offline):
        got = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16)
        assert got.choices[0].text == ref.outputs[0].text


def test_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    chunks = list(stream)
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 8
    assert all(c.usage is None for c in body)
    assert body[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == "The capital of France is Paris."
    assert body[-1].choices[0].finish_reason == "stop"


def test_a_streamed_request_of_several_prompts_interleaves_them_whole(client):
    """Several prompts in one streamed request (their streams merged): every choice's text
    comes whole and in order, as the same request answers without streaming."""
    args = dict(model=MODEL, prompt=["The sky is", "One, two,"], temperature=0, max_tokens=8)
    once = client.completions.create(**args, n=2)
    texts: dict[int, str] = {}
    finished = set()
    for chunk in client.completions.create(**args, n=2, stream=True):
        for c in chunk.choices:
            assert c.index not in finished  # nothing after a choice's finish_reason
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finished.add(c.index)
    assert finished == {0, 1, 2, 3}
    assert texts == {c.index: c.text for c in once.choices}
    assert texts[0] == texts[1] != texts[2] == texts[3]  # greedy: a prompt's n choices agree


def test_n_stop_seed_logprobs(client):
    many = client.completions.create(
        model=MODEL, prompt="My favourite animal is", n=3, temperature=1.0, seed=7, max_tokens=8
    )
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    again = client.completions.create(
        model=MODEL, prompt="My favourite animal is", n=3, temperature=1.0, seed=7, max_tokens=8
    )
    assert [c.text for c in again.choices] == [c.text for c in many.choices]
    stopped = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=16, stop=["."]
    )
    assert "." not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    lp = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        messages=[{"role": "user", "content": "Hi"}],
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].logprob <= 0 and content[0].top_logprobs[0].logprob >= content[0].logprob
    clp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, logprobs=3)
    assert len(clp.choices[0].logprobs.tokens) == 2


def test_echo_logit_bias_and_vllm_stop_extras(client, server):
    """echo: each choice's text starts with its own prompt (decoded when given as tokens), in
    one-shot and streamed responses; vLLM's include_stop_str_in_output keeps the stop string."""
    prompts = [[504, 3575, 282], [282, 504]]
    detok = [httpx.post(server.base + "/detokenize", json={"tokens": p}) for p in prompts]
    heads = [r.json()["prompt"] for r in detok]
    plain = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=6)
    echoed = client.completions.create(
        model=MODEL, prompt=prompts, temperature=0, max_tokens=6, n=2, echo=True
    )
    assert sorted(c.index for c in echoed.choices) == [0, 1, 2, 3]
    for c in echoed.choices:
        p = c.index // 2
        assert heads[p] and c.text == heads[p] + plain.choices[p].text
    text = "The capital of France is"
    args = dict(model=MODEL, prompt=text, temperature=0, max_tokens=6, echo=True)
    once = client.completions.create(**args)
    stream = client.completions.create(**args, stream=True)
    assert once.choices[0].text.startswith(text) and len(once.choices[0].text) > len(text)
    assert "".join(c.choices[0].text for c in stream) == once.choices[0].text
    kept = client.completions.create(
        model=MODEL,
        prompt=text,
        temperature=0,
        max_tokens=16,
        stop=["."],
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text.endswith(".") and kept.choices[0].finish_reason == "stop"
    (bang,) = httpx.post(
        server.base + "/tokenize", json={"prompt": "!", "add_special_tokens": False}
    ).json()["tokens"]
    forced = client.completions.create(
        model=MODEL, prompt=text, temperature=0, max_tokens=3, logit_bias={str(bang): 100}
    )
    assert forced.choices[0].text == "!!!"


def test_cached_tokens(client):
    prompt = "A fresh prompt about lighthouses and the sea, " * 6
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_tokenize_detokenize(server):
    h = {"Authorization": f"Bearer {KEY}"}
    tok = httpx.post(server.base + "/tokenize", json={"prompt": "Hello world"}, headers=h).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    text = httpx.post(server.base + "/detokenize", json={"tokens": tok["tokens"]}, headers=h).json()
    assert text["prompt"] == "Hello world"


def test_64_concurrent_streams(smollm_dense_llm):
    """Each of 64 concurrent streams gets its own request's tokens: float32 weights, whose
    greedy output does not change with how the server batches (packed weights round to bf16
    and can, docs/models.md)."""
    server = ServerProcess(
        "--kv-cache-memory", "512MiB", "--max-num-seqs", "64", "--quantization", "none",
        api_key=KEY,
    )  # fmt: skip
    try:
        _check_64_streams(server, smollm_dense_llm)
    finally:
        server.stop()


def _check_64_streams(server, reference) -> None:
    prompts = [f"Count from {i} to {i + 5}:" for i in range(64)]
    expected = [
        o.outputs[0].text
        for o in reference.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    ]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def run_all():
        aclient = openai.AsyncOpenAI(
            base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=300
        )
        return await asyncio.gather(*(one(aclient, p) for p in prompts))

    assert asyncio.run(run_all()) == expected
    stats = _engine(server)
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_disconnect_frees_blocks(server, client):
    body = {
        "model": MODEL,
        "prompt": "Tell me a very long story.",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", server.base + "/v1/completions", json=body, headers=h, timeout=60
    ) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data:") for line in got)
        assert _engine(server)["num_free_blocks"] < _engine(server)["num_blocks"]
    other = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=4)
    assert other.usage.completion_tokens == 4
    info = _engine(server)
    assert info["num_free_blocks"] == info["num_blocks"]
    assert info["stats"]["num_running"] == 0


BAD = [
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 5}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 9000}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-5", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "presence_penalty": 9},
        400,
        "presence_penalty",
    ),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "lone \ud8a2 surrogate"}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400, "one of"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "logit_bias": {"-3": 5}},
        400,
        "logit_bias",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json"}},
        400,
        "response_format",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "end"}, 400, "suffix"),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                    ],
                }
            ]
        },
        400,
        "image_url",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_input(server, path, body, status, param):
    h = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    # json.dumps escapes non-ASCII (a lone surrogate too), as JavaScript clients do
    r = httpx.post(server.base + path, content=json.dumps(body), headers=h, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert param in (err["param"] or "") or param in err["message"]


def test_malformed_auth_and_size(server):
    r = httpx.post(
        server.base + "/v1/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server.base + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    r = httpx.post(
        server.base + "/v1/completions",
        json={"model": MODEL, "prompt": "x"},
        headers={"Authorization": "Bearer wrong"},
    )
    assert r.status_code == 401
    big = json.dumps({"model": MODEL, "prompt": "x" * (9 * 2**20)})
    r = httpx.post(
        server.base + "/v1/completions",
        content=big,
        headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    assert httpx.get(server.base + "/health").status_code == 200  # still serving


def test_overload_and_graceful_shutdown():
    import signal
    import threading

    srv = ServerProcess(
        "--kv-cache-memory",
        "512MiB",
        "--max-num-seqs",
        "2",
        "--max-waiting-requests",
        "2",
        "--shutdown-timeout",
        "60",
    )
    try:

        async def flood():
            aclient = openai.AsyncOpenAI(
                base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=120
            )

            async def one():
                try:
                    await aclient.completions.create(
                        model=MODEL, prompt="Hi", max_tokens=24, extra_body={"ignore_eos": True}
                    )
                    return 200
                except openai.APIStatusError as exc:
                    assert exc.response.headers.get("retry-after")
                    return exc.status_code

            return await asyncio.gather(*(one() for _ in range(12)))

        codes = asyncio.run(flood())
        assert 503 in codes and 200 in codes and set(codes) <= {200, 503}
        # SIGTERM in the middle of a stream: the stream completes, the process exits 0
        texts: list[str] = []
        started = threading.Event()

        def consume():
            with httpx.stream(
                "POST",
                srv.base + "/v1/completions",
                timeout=120,
                json={
                    "model": MODEL,
                    "prompt": "Tell me a story",
                    "max_tokens": 40,
                    "ignore_eos": True,
                    "stream": True,
                },
            ) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data:"):
                        started.set()
                        texts.append(line)

        reader = threading.Thread(target=consume)
        reader.start()
        assert started.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        reader.join(120)
        assert texts[-1] == "data: [DONE]"
        assert json.loads(texts[-2][5:])["choices"][0]["finish_reason"] == "length"
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()


def test_engine_boots_and_steps_on_its_loop_thread(tiny_models):
    """The engine is built on the thread that steps it (libgomp slows a thread other than the
    one that booted torch); a boot error comes back to the caller."""
    import threading

    from kiln.errors import KilnError
    from kiln.server.async_engine import AsyncEngine
    from tests.helpers import make_engine

    booted_on = []

    def build():
        booted_on.append(threading.current_thread())
        return make_engine(tiny_models["llama"])

    engine = AsyncEngine(build)

    async def generate() -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = [o async for o in engine.generate("r", None, [5, 6, 7], params)]
        return outs[-1].outputs[0].token_ids

    try:
        assert booted_on == [engine._thread] and booted_on[0] is not threading.current_thread()
        assert len(asyncio.run(generate())) == 4
    finally:
        engine.stop(timeout=30)
    with pytest.raises(KilnError):
        AsyncEngine(lambda: make_engine("/nonexistent/model"))


def test_an_interrupted_boot_stops_the_booting_thread():
    """Ctrl-C while the engine boots on the loop thread ends that thread as well."""
    import _thread
    import signal
    import threading
    import time

    from kiln.server.async_engine import AsyncEngine

    started, threads = threading.Event(), []

    def hanging_boot():
        threads.append(threading.current_thread())
        started.set()
        while True:  # a boot phase stuck in Python code
            time.sleep(0.01)

    def press_ctrl_c():
        started.wait(30)
        _thread.interrupt_main()

    # interrupt_main simulates Ctrl-C only where Python handles SIGINT; a test run started in
    # the background (SIGINT ignored from process start) would otherwise wait forever
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=press_ctrl_c, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            AsyncEngine(hanging_boot)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(threads) == 1 and not threads[0].is_alive()


def test_the_openapi_document_asks_for_the_key_where_the_server_does(server):
    doc = httpx.get(server.base + "/openapi.json").json()
    completions = doc["paths"]["/v1/completions"]["post"]
    assert completions["security"] == [{"apiKey": []}] and "401" in completions["responses"]
    assert "security" not in doc["paths"]["/tokenize"]["post"]
    refused = httpx.post(server.base + "/v1/completions", json={"prompt": "x"})
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
