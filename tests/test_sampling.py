"""Sampling: filters on known distributions, penalties by hand, seeds across batch
compositions, stops, n > 1 and logprobs through the real engine."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

from kiln import SamplingParams
from kiln.runner.sampler import (
    SamplingBatch,
    apply_penalties,
    draw,
    filter_logits,
    greedy_tokens,
    sample,
    shape_logits,
)
from tests.helpers import load_benchmark, make_engine, run_schedule

PROBS = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])


def _seq(params: SamplingParams, tokens=(1, 2), prompt_len=1, generator=None):
    return SimpleNamespace(
        params=params,
        token_ids=list(tokens),
        num_prompt_tokens=prompt_len,
        num_output_tokens=len(tokens) - prompt_len,
        generator=generator,
    )


def _kept(params: SamplingParams) -> set[int]:
    logits = PROBS.log()[None, :]
    batch = SamplingBatch.build([_seq(params)], 5, torch.device("cpu"))
    out = filter_logits(logits, batch)
    return {i for i in range(5) if out[0, i] > float("-inf")}


@pytest.mark.parametrize(
    "params,expected",
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_k=1), {0}),
        (SamplingParams(top_p=0.6), {0, 1}),  # 0.5 < 0.6, then 0.5 + 0.2 covers it
        (SamplingParams(top_p=0.5), {0}),
        (SamplingParams(top_p=0.71), {0, 1, 2}),
        (SamplingParams(min_p=0.25), {0, 1, 2}),  # floor 0.125
        (SamplingParams(min_p=0.5), {0}),
        (SamplingParams(top_k=3, min_p=0.35), {0, 1}),  # floor 0.175 among the top 3
        (SamplingParams(), {0, 1, 2, 3, 4}),
    ],
)
def test_filters_keep_the_right_support(params, expected):
    assert _kept(params) == expected


def test_sampled_frequencies_follow_the_filtered_distribution():
    params = SamplingParams(temperature=1.0, top_p=0.8)  # keeps {0, 1, 2}: renormalised /0.85
    seqs = [_seq(params) for _ in range(4000)]
    batch = SamplingBatch.build(seqs, 5, torch.device("cpu"))
    out = sample(PROBS.log().repeat(4000, 1), batch, frozenset(), torch.Generator().manual_seed(0))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5).float() / 4000
    assert counts[3] == 0 and counts[4] == 0
    torch.testing.assert_close(counts[:3], PROBS[:3] / 0.85, atol=0.03, rtol=0)


def test_a_draw_follows_its_row_and_never_takes_a_zero():
    """The inverse-CDF draw: zero-probability tokens at the start, between and at the end of
    the row never come out (empty intervals), the rest at their probabilities (4 standard
    deviations at 20,000 draws), an unnormalised row as its normalisation; seeded rows from
    their own generators, whatever their place in the batch."""
    row = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25, 0.0])
    n = 20000
    seqs = [SimpleNamespace(generator=None)] * n
    for probs in (row.repeat(n, 1), 3 * row.repeat(n, 1)):
        tokens = draw(probs, seqs, torch.Generator().manual_seed(0))
        freq = torch.bincount(tokens, minlength=6).float() / n
        assert freq[[0, 2, 5]].sum() == 0
        torch.testing.assert_close(freq, row, atol=4 * (0.25 / n) ** 0.5, rtol=0)

    def seeded(i):
        return SimpleNamespace(generator=torch.Generator().manual_seed(i))

    flat = torch.full((8, 1000), 1e-3)
    alone = [draw(flat[:1], [seeded(i)], torch.Generator()).item() for i in range(8)]
    mixed = [seeded(i) if i % 2 else SimpleNamespace(generator=None) for i in range(8)]
    batch = draw(flat, mixed, torch.Generator().manual_seed(1)).tolist()
    assert batch[1::2] == alone[1::2] and len(set(alone)) > 1


def test_temperature_sharpens():
    seqs = [_seq(SamplingParams(temperature=0.25)) for _ in range(2000)]
    batch = SamplingBatch.build(seqs, 5, torch.device("cpu"))
    out = sample(PROBS.log().repeat(2000, 1), batch, frozenset(), torch.Generator().manual_seed(0))
    p = PROBS**4 / (PROBS**4).sum()  # softmax(log p / 0.25)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=5).float() / 2000
    torch.testing.assert_close(freq, p, atol=0.03, rtol=0)


def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    # prompt [0], output [1, 1, 3]
    seq = _seq(params, tokens=(0, 1, 1, 3), prompt_len=1)
    out = apply_penalties(logits, SamplingBatch.build([seq], 4, torch.device("cpu")))
    expected = torch.tensor(
        [
            [
                2.0 / 2,  # prompt token: repetition only
                -1.0 * 2 - 0.5 - 0.5,  # output twice: rep, presence, 2 x freq
                0.5,  # unseen
                1.0 / 2 - 0.5 - 0.25,
            ]
        ]
    )
    torch.testing.assert_close(out, expected)


def test_logit_bias_by_hand():
    """OpenAI's logit_bias (keys arrive as strings) is added to the logits before choosing;
    the logprobs stay the model's."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0]])
    params = SamplingParams(temperature=0, logit_bias={"2": 1.6, 0: -100}, logprobs=0)
    batch = SamplingBatch.build([_seq(params)], 4, torch.device("cpu"))
    out = sample(logits, batch, frozenset(), torch.Generator())
    assert out.token_ids == [2]  # 0.5 + 1.6 = 2.1 beats 1.0; token 0 at 2 - 100 drops out
    torch.testing.assert_close(out.logprobs, logits.log_softmax(-1))
    params = SamplingParams(temperature=1.0, logit_bias={3: -100, 1: -100, 2: -100})
    batch = SamplingBatch.build([_seq(params)] * 64, 4, torch.device("cpu"))
    out = sample(logits.expand(64, 4), batch, frozenset(), torch.Generator().manual_seed(0))
    assert set(out.token_ids) == {0}  # e^-100 of the mass is left to the others


@pytest.mark.parametrize(
    "bias,message",
    [({"x": 1}, "map token ids"), ({"5": 101}, "[-100, 100]"), ({"49152": 1}, "outside")],
)
def test_bad_logit_bias_is_a_clear_error(bias, message):
    from kiln.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=re.escape(message)) as err:
        SamplingParams(logit_bias=bias).validate_for_vocab(49152)
    assert err.value.param == "logit_bias"


def test_min_tokens_masks_eos():
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[3])
    seq = _seq(params, tokens=(0, 1), prompt_len=1)
    batch = SamplingBatch.build([seq], 5, torch.device("cpu"))
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 1.0]])
    out = sample(logits, batch, frozenset({2}), torch.Generator())
    assert out.token_ids == [4]  # EOS (2) and the stop token (3) are banned until 3 tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_greedy_tokens_is_argmax_with_its_ties_and_nans(dtype):
    """The first of tied maxima and a NaN's index, as torch.argmax picks them: one row, many rows
    over whole chunks and with a last partial chunk (the maximum there, or tied with the rest,
    or a NaN there), a vocabulary shorter than a chunk."""
    gen = torch.Generator().manual_seed(0)
    for rows, vocab in [(1, 49152), (64, 49152), (7, 33), (5, 1000), (9, 49155)]:
        x = torch.randint(0, 3, (rows, vocab), generator=gen).to(dtype)  # many ties
        assert torch.equal(greedy_tokens(x), x.argmax(-1))
        x[1 % rows, vocab - 1] = 7  # the maximum in the last (perhaps partial) chunk
        x[2 % rows, [5, vocab - 2]] = 5  # tied at both ends: the first wins
        assert torch.equal(greedy_tokens(x), x.argmax(-1))
        x[0, [vocab // 2, vocab - 1]] = float("nan")
        x[3 % rows, vocab - 1] = float("nan")  # a NaN in the tail alone
        x[-1, :] = float("-inf")
        assert torch.equal(greedy_tokens(x), x.argmax(-1))


def test_shape_logits_copies_only_when_it_changes_something():
    """Unshaped rows come back as the raw logits themselves; logit_bias, min_tokens and
    penalties work on a copy and leave the raw logits (the logprobs' source) unchanged."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0], [0.0, 1.0, 2.0, 3.0]])
    plain = SamplingBatch.build([_seq(SamplingParams(temperature=0))] * 2, 4, torch.device("cpu"))
    assert shape_logits(logits, plain, frozenset({3})) is logits
    # min_tokens that bans nothing (EOS ignored, no stop tokens: what `kiln bench` sends) is no
    # change either: no copy of the logits at every step
    nothing = SamplingParams(temperature=0, min_tokens=5, ignore_eos=True)
    batch = SamplingBatch.build([_seq(nothing)] * 2, 4, torch.device("cpu"))
    assert shape_logits(logits, batch, frozenset({3})) is logits
    raw = logits.clone()
    for params in [
        SamplingParams(temperature=0, logit_bias={1: 5}),
        SamplingParams(temperature=0, min_tokens=5),
        SamplingParams(temperature=0, min_tokens=5, ignore_eos=True, stop_token_ids=[2]),
        SamplingParams(temperature=0, repetition_penalty=2.0),
    ]:
        seqs = [_seq(SamplingParams(temperature=0)), _seq(params)]
        batch = SamplingBatch.build(seqs, 4, torch.device("cpu"))
        shaped = shape_logits(logits, batch, frozenset({3}))
        assert shaped is not logits and not torch.equal(shaped, raw)
        assert torch.equal(logits, raw)


# ---- through the engine ------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_models):
    return make_engine(tiny_models["qwen2"])


def _prompt(seed: int, n: int = 12) -> list[int]:
    return torch.randint(3, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_seed_reproducible_whatever_the_batch(engine):
    params = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone, _ = run_schedule(engine, [(0, _prompt(0), params)])
    others = [
        (0, _prompt(s), SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True))
        for s in range(1, 5)
    ]
    crowded, _ = run_schedule(engine, [*others[:2], (2, _prompt(0), params), *others[2:]])
    assert crowded["2"].outputs[0].token_ids == alone["0"].outputs[0].token_ids
    other_seed = SamplingParams(temperature=1.0, top_k=50, seed=99, max_tokens=12, ignore_eos=True)
    different, _ = run_schedule(engine, [(0, _prompt(0), other_seed)])
    assert different["0"].outputs[0].token_ids != alone["0"].outputs[0].token_ids


def test_n_completions_differ_and_are_counted(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    out, _ = run_schedule(engine, [(0, _prompt(7), params)])
    outs = out["0"].outputs
    assert [o.index for o in outs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs}) == 3
    assert out["0"].num_completion_tokens == 24


def test_logprobs_are_the_models(engine, tiny_models):
    from transformers import AutoModelForCausalLM

    prompt = _prompt(8)
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=4, ignore_eos=True)
    out, _ = run_schedule(engine, [(0, prompt, params)])
    comp = out["0"].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"]).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + comp.token_ids])).logits[0].log_softmax(-1)
    total = 0.0
    for i, lp in enumerate(comp.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert lp.sampled.token_id == comp.token_ids[i]
        assert math.isclose(lp.sampled.logprob, row[lp.sampled.token_id].item(), abs_tol=1e-4)
        assert [t.token_id for t in lp.top] == row.topk(4).indices.tolist()
        total += lp.sampled.logprob
    assert math.isclose(comp.cumulative_logprob, total, abs_tol=1e-5)


def test_stop_token_ids_and_max_tokens(engine):
    base, _ = run_schedule(
        engine, [(0, _prompt(9), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))]
    )
    tokens = base["0"].outputs[0].token_ids
    assert base["0"].outputs[0].finish_reason == "length" and len(tokens) == 10
    stop_at = tokens[4]
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at], ignore_eos=True)
    out, _ = run_schedule(engine, [(0, _prompt(9), params)])
    comp = out["0"].outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop_at
    assert comp.token_ids == tokens[: tokens.index(stop_at) + 1]


def test_stop_string_is_not_returned(engine):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base, _ = run_schedule(engine, [(0, _prompt(10), params)])
    text = base["0"].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3 and stop in text
    out, _ = run_schedule(
        engine,
        [
            (
                0,
                _prompt(10),
                SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]),
            )
        ],
    )
    comp = out["0"].outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.text == text[: text.index(stop)]


def test_streamed_deltas_never_contain_the_stop_string(engine):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    text = run_schedule(engine, [(0, _prompt(10), params)])[0]["0"].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    engine.add_request(
        "s", _prompt(10), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    )
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o.outputs[0].delta_text for o in engine.step()]
    assert "".join(deltas) == text[: text.index(stop)]


def test_min_tokens_with_stop_strings_keeps_the_text_and_ignores_early_stops(engine):
    """Like vLLM: stop strings count only once min_tokens are out, and the text generated
    before then is part of the output."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = run_schedule(engine, [(0, _prompt(10), params)])[0]["0"].outputs[0]
    first = engine.tokenizer.decode(base.token_ids[:1])
    assert first and first in base.text
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, min_tokens=4, stop=["\x00never", first]
    )
    comp = run_schedule(engine, [(0, _prompt(10), params)])[0]["0"].outputs[0]
    if first in base.text[len(first) :]:  # the stop string recurs after the first 4 tokens
        assert comp.finish_reason == "stop" and len(comp.token_ids) >= 4
        assert comp.text.startswith(first) and base.text.startswith(comp.text)
    else:
        assert comp.finish_reason == "length" and comp.text == base.text
    assert comp.token_ids == base.token_ids[: len(comp.token_ids)]


def test_candidate_filter_equals_full_sort_on_a_real_vocabulary():
    """Filtering among the top CANDIDATES logits must keep exactly what sorting the whole
    vocabulary keeps: rows whose nucleus ends inside the candidates take the fast path, wider
    ones the WIDE_CANDIDATES, the others (flat distributions, top_p near 1) the sort."""
    from kiln.runner.sampler import (
        CANDIDATES,
        WIDE_CANDIDATES,
        WIDE_REACH,
        _filter_candidates,
        _filter_sorted,
    )

    vocab = 49152
    g = torch.Generator().manual_seed(3)
    sharpness = [8.0, 4.0, 2.0, 1.0, 0.3, 0.05]  # peaked ... nearly flat
    params = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.5, top_k=40),
        SamplingParams(temperature=1.0, top_p=0.999),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=1000),  # wider than the candidates
        SamplingParams(temperature=1.0),  # no filter in a filtered batch
        SamplingParams(temperature=1.0, top_p=0.95, min_p=0.01),
    ]
    rows = [(s, p) for s in sharpness for p in params]
    logits = torch.stack([torch.randn(vocab, generator=g) * s for s, _ in rows])
    batch = SamplingBatch.build([_seq(p) for _, p in rows], vocab, torch.device("cpu"))
    fast = filter_logits(logits, batch)
    reference = _filter_sorted(logits, batch)
    assert torch.equal(fast > float("-inf"), reference > float("-inf"))
    kept = reference > float("-inf")
    assert torch.equal(fast[kept], logits[kept])
    _, narrow, reach = _filter_candidates(logits, batch, CANDIDATES)
    _, wide, _ = _filter_candidates(logits, batch, WIDE_CANDIDATES)
    tried = ~narrow & (reach >= WIDE_REACH)  # all three paths ran, and the wide one paid off
    assert narrow.any() and (tried & wide).any() and (~narrow & ~tried).any()
    assert kept.sum(-1).min() >= 1 and kept.sum(-1).max() > CANDIDATES
    # a row without filters keeps the whole vocabulary even beside rows with top_p (a float
    # cumsum reaching 1 before the tail used to drop its least likely tokens)
    assert kept[params.index(SamplingParams(temperature=1.0))].all()


def test_the_sampling_benchmark_times_a_step():
    bench = load_benchmark("sampling")
    for params in bench.SETTINGS.values():
        assert bench.step_ms(params, rows=2, vocab=300, repeats=1) > 0
