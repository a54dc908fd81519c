"""Benchmark prompts of a requested size, built from the real texts in `corpus/`.

A prompt is a system message that starts with a run-scoped unique tag (so no two requests
share a prefix: the cold protocol) and a user message holding an excerpt of the suite's text
and the instruction to continue it at length. The excerpt is cut so the whole chat prompt lands
as close to the target as the server's own token count allows."""

from __future__ import annotations

import gzip
import hashlib
import os
from dataclasses import dataclass

from kiln.bench.client import BenchError
from kiln.bench.tokens import Messages, TokenCounter

CORPUS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


@dataclass(frozen=True)
class Suite:
    name: str
    corpus_file: str
    system: str
    instruction: str  # the user message; {excerpt} is replaced by the text


SUITES = {
    "regular": Suite(
        "regular",
        "prose_genesis_kjv.txt.gz",
        "You are a storyteller who writes long, plain narrative prose.",
        "Here is the beginning of a book:\n\n{excerpt}\n\nContinue the narrative from where it "
        "stops, in the same plain style, at length. Do not summarize and do not repeat it.",
    ),
    "coding": Suite(
        "coding",
        "code_cpython_stdlib.txt.gz",
        "You are a Python programmer who writes complete, working modules.",
        "Here is existing Python code for reference:\n\n```python\n{excerpt}\n```\n\nWrite one "
        "new, complete Python module in the same style: a command-line tool that parses its "
        "arguments, reads text files and reports statistics about them, with docstrings.",
    ),
}


def suite_names(choice: str) -> list[str]:
    if choice == "all":
        return list(SUITES)
    if choice not in SUITES:
        raise BenchError(f"unknown suite {choice!r}: use regular, coding or all")
    return [choice]


def read_corpus(suite: Suite) -> str:
    with gzip.open(os.path.join(CORPUS_DIR, suite.corpus_file), "rt", encoding="utf-8") as f:
        return f.read()


def request_tag(run_id: str, index: int) -> str:
    """Unique per request from its first characters, so even the first KV block of two
    requests differs (a shared run id up front would be a 16-token prefix hit). Same width for
    every index, so tags cost about the same tokens in every request."""
    nonce = hashlib.sha256(f"{run_id}:{index}".encode()).hexdigest()[:8]
    return f"[{nonce} kiln-bench run {run_id} request {index:06d}]"


@dataclass(frozen=True)
class BenchPrompt:
    suite: str
    target_tokens: int
    excerpt: str
    counted_tokens: int  # as counted with a sample tag
    count_method: str

    def messages(self, tag: str) -> Messages:
        s = SUITES[self.suite]
        return [
            {"role": "system", "content": f"{tag} {s.system}"},
            {"role": "user", "content": s.instruction.format(excerpt=self.excerpt)},
        ]


def skeleton(suite: str, tag: str) -> Messages:
    return BenchPrompt(suite, 0, "", 0, "").messages(tag)


async def build_prompt(
    suite: str, target: int, counter: TokenCounter, tolerance_percent: float, run_id: str
) -> BenchPrompt:
    """The longest excerpt whose prompt has at most `target` tokens; an error when even that
    lands outside the tolerance (the target is below the instruction's own size)."""
    text = read_corpus(SUITES[suite])
    tag = request_tag(run_id, 0)

    async def count(n_chars: int) -> int:  # reads `text` late: it may be lengthened below
        excerpt = _cut(text, n_chars)
        return await counter.count(BenchPrompt(suite, target, excerpt, 0, "").messages(tag))

    base = await count(0)
    if base >= target:
        raise BenchError(
            f"a {suite} prompt needs at least {base + 1} tokens (its instruction alone is {base}); "
            f"ask for a larger size than {target}"
        )
    text = await _long_enough(text, target, count, base)
    lo, hi = 0, len(text)
    while hi - lo > 1:  # invariant: count(lo) <= target < count(hi) (or hi is the end)
        mid = (lo + hi) // 2
        if await count(mid) <= target:
            lo = mid
        else:
            hi = mid
    best = _cut(text, lo)
    got = await count(lo)
    if abs(got - target) / target * 100 > tolerance_percent:
        raise BenchError(
            f"could not build a {suite} prompt of {target} tokens within "
            f"{tolerance_percent}% (closest: {got}); raise --input-size-tolerance-percent"
        )
    return BenchPrompt(suite, target, best, got, counter.method)


async def _long_enough(text: str, target: int, count, base: int) -> str:
    """Targets beyond the corpus repeat it; the tag keeps such prompts distinct anyway."""
    full = await count(len(text))
    if full <= target:
        copies = -(-(target - base) // max(1, full - base)) + 1
        text = "\n\n".join([text] * copies)
    return text


def _cut(text: str, n_chars: int) -> str:
    """The first n_chars, ending at a whitespace so no word is split."""
    if n_chars >= len(text):
        return text
    cut = text.rfind(" ", 0, n_chars + 1)
    cut = max(cut, text.rfind("\n", 0, n_chars + 1))
    return text[: max(cut, 0)]
