"""Eager steps on the CPU run at a bounded set of token counts (kiln/runner/padding.py): the
padding rows change no real row's output, and the sizes a server meets stay few."""

from __future__ import annotations

import dataclasses

import torch

from kiln import SamplingParams
from kiln.runner.padding import EXACT_UP_TO, padded_token_count
from tests.helpers import make_engine, run_schedule


def test_the_buckets_are_few_cover_every_count_and_waste_little():
    limit = 512
    sizes = {n: padded_token_count(n, limit) for n in range(1, limit + 1)}
    assert all(n <= p <= limit for n, p in sizes.items())
    assert all(sizes[n] == n for n in range(1, EXACT_UP_TO + 1))
    assert all(p - n <= max(7, n / 8) for n, p in sizes.items())
    assert len(set(sizes.values())) <= 40  # 8 exact, 7 to 64, then 8 per doubling
    assert padded_token_count(600, 640) == 640 and padded_token_count(600, 610) == 610


def _schedule() -> list:
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 40, 70, 9)]
    return [(step, p, greedy) for step, p in zip((0, 0, 1, 2, 2), prompts)]


def _record_sizes(runner) -> list[int]:
    """The token count of every forward the runner makes from now on."""
    sizes, forward = [], runner.forward
    runner.forward = lambda ids, *args: sizes.append(ids.shape[0]) or forward(ids, *args)
    return sizes


def test_padding_rows_change_no_output(tiny_models):
    """The same mixed schedule (decodes beside prefill chunks, odd sizes) with and without the
    padding: the same tokens, and logits equal to float32 rounding."""
    results = []
    for padding in ("on", "off"):
        engine = make_engine(tiny_models["qwen3"], max_num_batched_tokens=64)
        engine.runner.pad_eager_steps = padding == "on"
        sizes = _record_sizes(engine.runner)
        results.append((*run_schedule(engine, _schedule(), record_logits=True), sizes))
    (padded, padded_logits, padded_sizes), (exact, exact_logits, exact_sizes) = results
    assert any(p > e for p, e in zip(padded_sizes, exact_sizes))  # padding did happen
    assert all(p == padded_token_count(e, 64) for p, e in zip(padded_sizes, exact_sizes))
    for rid, out in exact.items():
        assert padded[rid].outputs[0].token_ids == out.outputs[0].token_ids
        torch.testing.assert_close(
            torch.stack(padded_logits[rid]), torch.stack(exact_logits[rid]), rtol=1e-4, atol=1e-4
        )


def test_auto_pads_on_the_cpu_only():
    from kiln.config import EngineConfig
    from kiln.runner.padding import pads_eager_steps

    assert EngineConfig().eager_step_padding == "auto"
    assert pads_eager_steps("auto", "cpu") and not pads_eager_steps("auto", "cuda")
    assert pads_eager_steps("on", "cuda") and not pads_eager_steps("off", "cpu")
    assert "eager_step_padding" in {f.name for f in dataclasses.fields(EngineConfig)}
