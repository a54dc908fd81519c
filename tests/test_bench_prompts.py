"""Benchmark prompts land within the size tolerance, counted by the embedded model's tokenizer
(the same chat template and tokenizer a kiln server counts with), and no two requests of a run
share even their first KV block."""

from __future__ import annotations

import asyncio

import pytest

from kiln.bench.client import BenchError
from kiln.bench.prompts import SUITES, build_prompt, read_corpus, request_tag
from kiln.bench.tokens import make_counter
from kiln.cli.parsers import parse_size


@pytest.fixture(scope="module")
def counter(smollm_path):
    return asyncio.run(make_counter(None, [], tokenizer_path=smollm_path))


@pytest.fixture(scope="module")
def tokenizer(smollm_path):
    from kiln.loader import open_model

    return open_model(smollm_path).load_tokenizer()


@pytest.mark.parametrize("suite", list(SUITES))
@pytest.mark.parametrize("size", [256, 1024, 4096, 16384])
def test_prompt_size_within_tolerance(counter, suite, size):
    prompt = asyncio.run(build_prompt(suite, size, counter, 2.0, "0123abcd"))
    assert abs(prompt.counted_tokens - size) <= size * 0.02
    # a request with any other tag counts the same within the tolerance
    other = asyncio.run(counter.count(prompt.messages(request_tag("0123abcd", 4711))))
    assert abs(other - size) <= size * 0.02
    assert prompt.excerpt and prompt.excerpt in read_corpus(SUITES[suite])


def test_prompt_beyond_the_corpus_repeats_it(counter):
    prompt = asyncio.run(build_prompt("regular", 60000, counter, 1.0, "0123abcd"))
    assert abs(prompt.counted_tokens - 60000) <= 600
    assert len(prompt.excerpt) > len(read_corpus(SUITES["regular"]))


def test_prompt_smaller_than_the_instruction_is_an_error(counter):
    with pytest.raises(BenchError, match="at least"):
        asyncio.run(build_prompt("coding", 20, counter, 5.0, "0123abcd"))


def test_request_tags_differ_in_the_first_kv_block(tokenizer):
    """The cold protocol: a 16-token block shared by two requests would be a prefix-cache hit."""

    def first_block(index: int) -> list[int]:
        msgs = [{"role": "system", "content": request_tag("feedc0de", index) + " You are"}]
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
        return tokenizer.encode(text, add_special_tokens=False)[:16]

    blocks = [tuple(first_block(i)) for i in range(200)]
    assert len(set(blocks)) == len(blocks)


def test_corpora_are_the_documented_texts():
    prose = read_corpus(SUITES["regular"])
    code = read_corpus(SUITES["coding"])
    assert prose.startswith("THE FIRST BOOK OF MOSES") and "CHAPTER 50" in prose
    assert "In the beginning God created the heaven and the earth." in prose
    for module in ("textwrap", "fractions", "difflib", "argparse"):
        assert f"# ===== CPython 3.11.7, Lib/{module}.py =====" in code
    compile(code, "corpus", "exec")  # real, whole Python modules


@pytest.mark.parametrize(
    ("text", "tokens"), [("512", 512), ("1k", 1024), ("16K", 16384), (" 2m ", 2 * 1024**2)]
)
def test_parse_size(text, tokens):
    assert parse_size(text) == tokens


@pytest.mark.parametrize("text", ["", "1.5k", "k", "12g", "-3"])
def test_parse_size_rejects(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)
