"""The `kiln` command, run as a user would."""

from __future__ import annotations

import subprocess
import sys


def _kiln(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_with_the_embedded_model():
    res = _kiln("generate", "What is the capital of France?", "--max-tokens", "24")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


def test_generate_raw_skips_the_template():
    res = _kiln("generate", "The capital of France is", "--raw", "--max-tokens", "4")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()


def test_bad_flag_is_one_clear_line():
    res = _kiln("generate", "hi", "--top-p", "2")
    assert res.returncode == 2
    assert res.stderr.strip() == "error: top_p must be in (0, 1], got 2.0"
    res = _kiln("generate", "hi", "--model", "/no/such/model.gguf")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "not found" in res.stderr
    res = _kiln("generate", "hi", "--kv-cache-memory", "1GiB", "--kv-cache-memory-fraction", "0.3")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "pass one" in res.stderr  # was: the byte count silently won


def test_info_prints_architecture_and_config():
    res = _kiln("info", "--kv-cache-memory", "512MiB")
    assert res.returncode == 0, res.stderr
    for word in ("LlamaForCausalLM", "layers", "30", "max_model_len", "KV cache", "torch_paged"):
        assert word in res.stdout


def test_chat_is_multi_turn():
    res = _kiln(
        "chat",
        "--max-tokens",
        "24",
        stdin="What is the capital of France?\nAnd what is 1 + 1?\n/exit\n",
    )
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout
    assert "2" in res.stdout.split("Paris", 1)[1]
