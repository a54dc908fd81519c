"""Incremental detokenization: same text as a one-shot decode, no broken characters."""

from __future__ import annotations

import pytest

from kiln.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Plain ASCII text, with punctuation!",
    "Ünïcödé: naïve café, Zürich, Kraków — “quotes”…",
    "Emoji 🙂🚀👩‍💻 and CJK 日本語のテキスト 中文 한국어",
    "  leading spaces\n\nnew lines\ttabs  ",
    "<|im_start|>user\nspecial tokens<|im_end|>",
]


@pytest.fixture(scope="module")
def tokenizer(smollm_llm):
    return smollm_llm.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_one_shot(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer.backend, stop=[])
    deltas = []
    for t in ids:
        assert detok.add_token(t) is None
        deltas.append(detok.take_delta(final=False))
    deltas.append(detok.take_delta(final=True))
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_split_across_tokens_is_withheld(tokenizer):
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits this emoji
    detok = IncrementalDetokenizer(tokenizer.backend, stop=[])
    for t in ids[:-1]:
        detok.add_token(t)
        assert detok.take_delta(final=False) == ""
    detok.add_token(ids[-1])
    assert detok.take_delta(final=False) == "🚀"


def test_stop_string_spanning_tokens_is_cut(tokenizer):
    ids = tokenizer.encode("The answer is forty-two. END of story", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer.backend, stop=["END"])
    hit = None
    emitted = ""
    for t in ids:
        hit = detok.add_token(t)
        emitted += detok.take_delta(final=hit is not None)
        if hit:
            break
    assert hit == "END"
    assert emitted == "The answer is forty-two. "
