"""The OpenAPI document against the server, by schemathesis with every check: requests generated
from /openapi.json, valid ones answered, invalid ones refused with a 4xx, and every status,
header, content type and body as the document states. Derandomized, so CI sees the same draws
every run; `schemathesis.toml` (used from the repository root) holds what the CLI run needs."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.server_helpers import ServerProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def fuzz_server():
    # a short context keeps every generated request cheap on the CPU; a small waiting bound
    # shows requests larger than it admitted whole
    srv = ServerProcess(
        "--kv-cache-memory", "256MiB", "--max-model-len", "64", "--max-num-seqs", "32",
        "--max-waiting-requests", "8",
    )  # fmt: skip
    yield srv
    srv.stop()


def test_schemathesis_finds_the_document_true(fuzz_server):
    command = [
        os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run",
        fuzz_server.base + "/openapi.json", "--checks", "all", "--generation-deterministic",
        "--max-examples", "8", "--no-color", "--output-sanitize", "false",
    ]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-6000:]
    assert "9 passed" in run.stdout or "Tested: 9" in run.stdout, run.stdout[-3000:]
    assert httpx.get(fuzz_server.base + "/health").status_code == 200


def test_requests_the_document_allows_are_answered(fuzz_server):
    """What schemathesis found refused before the document said so: an empty prompt is now
    schema-invalid; a request larger than the waiting bound, max_tokens beyond the context,
    min_tokens above max_tokens and a seed beyond 64 bits are served."""
    base = fuzz_server.base + "/v1/completions"
    assert httpx.post(base, json={"prompt": ""}).status_code == 400
    # 2 prompts x n=5: more than the 8 the queue holds, admitted whole on an empty queue
    body = {"prompt": ["a", "b"], "n": 5, "max_tokens": 10**9, "min_tokens": 10**6,
            "temperature": 0.5, "seed": 2**70, "ignore_eos": True}  # fmt: skip
    out = httpx.post(base, json=body, timeout=300).json()
    assert len(out["choices"]) == 10
    # each ran to the 64-token context: max_tokens capped to what the prompt left, and
    # min_tokens to max_tokens
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    usage = out["usage"]  # the prompts counted once, each of the 5 answers to each
    assert usage["completion_tokens"] == 5 * (2 * 64 - usage["prompt_tokens"])
    both = {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(fuzz_server.base + "/tokenize", json=both).status_code == 400
