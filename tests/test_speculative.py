"""Speculative decoding: the configuration's checks, the n-gram proposer against hand-worked
lookups, the verification rules against the target's distribution (a statistical test on a
small vocabulary), and the engine with n-gram drafts giving greedy output token for token
equal to the engine without them: the embedded model, the tiny models, mixed with requests
that do not speculate, under preemption, with prefix hits, in every graph mode, with no KV
block left behind."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kiln import SamplingParams, build_engine
from kiln.config import CompilationConfig
from kiln.config.options import engine_config
from kiln.config.speculative import SpeculativeConfig
from kiln.engine.sequence import Sequence
from kiln.errors import ConfigError
from kiln.outputs import RequestMetrics
from kiln.runner.verify import verify
from kiln.spec.ngram import propose_ngram
from tests.helpers import make_engine, run_schedule

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip


def _with_spec(engine_config_, spec=NGRAM):
    return replace(engine_config_, speculative=SpeculativeConfig.from_json(spec))


# ---- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
        ('{"method": "ngrm", "num_speculative_tokens": 2}', "did you mean 'ngram'"),
        ('{"method": "ngram"}', 'needs "num_speculative_tokens"'),
        ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "unknown"),
        ("{method: ngram}", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "above prompt_lookup_max",
        ),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', '"model" is for'),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}',
            "disable_by_batch_size must be",
        ),
    ],
)
def test_bad_speculative_configs_are_clear_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        engine_config(None, speculative_config=spec)


def test_ngram_lookup_bounds_default_as_vllm():
    assert SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2}) == (
        SpeculativeConfig("ngram", 2, 5, 5)
    )
    only_max = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    assert SpeculativeConfig.from_json(only_max).prompt_lookup_min == 3
    assert SpeculativeConfig.from_json("{}") is None


def test_methods_the_model_cannot_run_are_refused(tiny_models):
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    base = engine_config(tiny_models["llama"], kv_cache_memory=2**20)
    with pytest.raises(ConfigError, match="MTP"):
        build_engine(_with_spec(base, mtp))


# ---- the n-gram proposer -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "k", "lo", "hi", "expect"),
    [
        ([1, 2, 3, 4, 1, 2, 3], 3, 1, 3, [4, 1, 2]),  # suffix 1 2 3 seen at 0
        ([1, 2, 3, 4, 5, 1, 2, 3], 3, 1, 3, [4, 5, 1]),
        ([1, 2, 3, 9, 2, 3], 2, 1, 3, [9, 2]),  # the longest suffix that recurs: 2 3
        ([5, 6, 7], 2, 1, 3, []),  # nothing recurs
        ([1, 2, 3, 1, 2], 3, 3, 5, []),  # only 2 tokens recur, min 3
        ([1, 2, 1, 2, 1, 2], 3, 2, 5, [1, 2]),  # the 4-token match at 2, 2 tokens after it
        ([8, 1, 5, 9, 1, 5, 7, 1], 2, 1, 1, [5, 7]),  # the latest copy with k tokens after
        ([7], 3, 1, 3, []),
    ],
)
def test_ngram_proposals(ids, k, lo, hi, expect):
    assert propose_ngram(ids, k, lo, hi) == expect


# ---- verification keeps the target's distribution -----------------------------------------


def _seqs(n: int, params: SamplingParams) -> list[Sequence]:
    return [Sequence(i, str(i), 0, [1, 2], 2, params, None, RequestMetrics(0.0))
            for i in range(n)]  # fmt: skip


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability zero was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


CHI2_999 = {5: 20.52, 3: 16.27}  # the chi-square quantile 0.999 by degrees of freedom


@pytest.mark.parametrize("with_q", [False, True], ids=["ngram-rule", "draft-rule"])
def test_verified_tokens_have_the_target_distribution(with_q):
    """2 drafts per sequence over 6 tokens: the first token out is distributed as the target's
    shaped p0 (temperature 0.7, top-k 4), and after an accepted first draft the second as p1.
    The draft rule draws its drafts from a known q; the n-gram rule takes fixed ones."""
    n, vocab = 6000, 6
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(3, vocab, generator=g) * 1.5
    params = SamplingParams(temperature=0.7, top_k=4)
    top = raw.topk(4, -1)
    shaped = torch.full_like(raw, float("-inf")).scatter(1, top.indices, top.values / 0.7)
    p = shaped.softmax(-1)
    q = torch.tensor([[0.05, 0.3, 0.3, 0.05, 0.2, 0.1], [0.3, 0.1, 0.2, 0.1, 0.1, 0.2]])
    if with_q:
        drafts = torch.stack([torch.multinomial(q[j], n, True, generator=g) for j in range(2)], 1)
    else:
        drafts = torch.tensor([[int(p[0].argsort()[-2]), int(p[1].argmax())]]).expand(n, 2)
    seqs = _seqs(n, params)
    logits = raw.repeat(n, 1)  # each sequence's 3 positions in order
    gen = torch.Generator().manual_seed(1)
    draft_probs = [q] * n if with_q else None
    out = verify(logits, seqs, drafts.tolist(), frozenset(), gen, draft_probs).token_ids
    first = torch.tensor([o[0] for o in out])
    assert _chi_square(first, p[0]) < CHI2_999[5]
    kept = [o[1] for o in out if len(o) > 1]  # the first draft accepted
    assert len(kept) > 300
    assert _chi_square(torch.tensor(kept), p[1]) < CHI2_999[3]  # top-k 4: 3 degrees of freedom
    # the test can fail: the drafts alone are far from p (total variation distance)
    drafted = torch.bincount(drafts[:, 0], minlength=vocab) / n
    assert (drafted - p[0]).abs().sum() / 2 > 0.25


def test_greedy_verification_keeps_the_matching_prefix():
    logits = torch.full((4, 8), -1.0)
    for row, best in enumerate([3, 5, 6, 2]):
        logits[row, best] = 1.0
    seqs = _seqs(1, SamplingParams(temperature=0))
    gen = torch.Generator()
    assert verify(logits, seqs, [[3, 5, 7]], frozenset(), gen).token_ids == [[3, 5, 6]]
    assert verify(logits, seqs, [[3, 5, 6]], frozenset(), gen).token_ids == [[3, 5, 6, 2]]
    assert verify(logits, seqs, [[4, 5, 6]], frozenset(), gen).token_ids == [[3]]


# ---- the engine ----------------------------------------------------------------------------


def _free_everything(engine) -> None:
    """Every KV block free again (cached ones included) and no sequence left."""
    assert not engine.has_unfinished_requests()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


EDITS = [
    "Copy the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape\n"
    "Copy: apple, banana, cherry,",
    "def area(width, height):\n    return width * height\n\n\ndef volume(width, height, "
    "depth):\n    return width * height * depth\n\n\ndef",
    "The capital of France is",
]


def test_embedded_model_greedy_output_is_unchanged(smollm_dense_llm):
    """n-gram drafts on the embedded model (float32, dense: its greedy output does not depend
    on the batch), three prompts at once, one of which finds nothing to look up at first."""
    reference = smollm_dense_llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    two = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2)
    stop = SamplingParams(temperature=0, max_tokens=40, stop=["fig"], logprobs=2)
    spec = build_engine(_with_spec(reference.config))
    ids = [reference.tokenizer.encode(p) for p in EDITS]
    arrivals = [(0, ids[0], stop), (0, ids[1], two), (2, ids[2], params)]
    want, _ = run_schedule(reference, arrivals)
    got, _ = run_schedule(spec, arrivals)
    for rid in want:
        for a, b in zip(got[rid].outputs, want[rid].outputs, strict=True):
            assert a.token_ids == b.token_ids and a.text == b.text
            assert a.finish_reason == b.finish_reason
    listed = got["0"].outputs[0]
    assert listed.finish_reason == "stop" and listed.stop_reason == "fig"
    for a, b in zip(listed.logprobs, want["0"].outputs[0].logprobs, strict=True):
        assert a.sampled.token_id == b.sampled.token_id  # each kept token's own row
        assert abs(a.sampled.logprob - b.sampled.logprob) < 1e-3
    st = spec.stats().spec_decode
    assert st["num_accepted_tokens"] > 10, st  # the drafts did their part
    assert st["num_accepted_tokens"] < st["num_draft_tokens"]  # and some were rolled back
    assert spec.num_steps < reference.num_steps
    _free_everything(spec)


def _tiny_workload():
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 49000, (20,), generator=g).tolist()
    prompts = [torch.randint(3, 49000, (n,), generator=g).tolist() for n in (5, 30, 12)]
    prompts += [shared + prompts[0], shared + prompts[2]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    stop_early = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    # penalties over the tokens before each verified position, drafts included
    penalized = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                               repetition_penalty=1.3, frequency_penalty=0.4)  # fmt: skip
    params = [greedy, penalized, stop_early, greedy, greedy]
    return [(t, p, sp) for t, p, sp in zip([0, 0, 1, 3, 4], prompts, params)]


@pytest.mark.parametrize(
    ("kv", "mode"), [(2**20, 0), (72 * 512, 0), (2**20, 3)], ids=["roomy", "preempting", "mode3"]
)
def test_tiny_model_greedy_output_is_unchanged(tiny_models, kv, mode):
    """Arrivals at different steps, prefix hits, a request that stops inside a verified run
    of drafts, and a KV budget that forces preemption (512 bytes of KV per token); eager and
    compiled (the CPU backend's op inside one Inductor graph)."""
    path = tiny_models["llama"]
    kwargs = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=8, kv_cache_memory=kv,
                  max_model_len=64, compilation=CompilationConfig(mode=mode))  # fmt: skip
    reference = make_engine(path, **kwargs)
    want, _ = run_schedule(reference, _tiny_workload())
    spec = build_engine(_with_spec(reference.config, NGRAM | {"disable_by_batch_size": 8}))
    got, _ = run_schedule(spec, _tiny_workload())
    for rid in want:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
    assert got["2"].outputs[0].finish_reason == "length"
    assert len(got["2"].outputs[0].token_ids) == 7
    st = spec.stats()
    assert st.spec_decode["num_accepted_tokens"] > 0
    if kv < 2**20:
        assert st.num_preemptions > 0
    else:  # with room, the shared prefix stays cached
        assert got["4"].num_cached_tokens > 0
    _free_everything(spec)


def test_aborts_and_batch_size_switch_leave_nothing_behind(tiny_models):
    path = tiny_models["llama"]
    engine = make_engine(path, block_size=4, max_num_batched_tokens=32, max_num_seqs=8)
    engine = build_engine(_with_spec(engine.config, NGRAM | {"disable_by_batch_size": 2}))
    engine.speculator.pad_drafts = True  # k drafts every step, found or filled: most rejected
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, (_, prompt, _) in enumerate(_tiny_workload()[:3]):
        engine.add_request(str(i), prompt, params)
    for _ in range(6):
        engine.step()
    assert engine.stats().spec_decode["num_disabled_steps"] > 0  # three running, limit two
    before = engine.stats().spec_decode
    engine.abort_request("0")
    engine.step()
    st = engine.stats().spec_decode
    assert st["num_drafts"] - before["num_drafts"] == 2  # two running: both speculated
    assert st["num_draft_tokens"] - before["num_draft_tokens"] == 6
    assert st["num_accepted_tokens"] - before["num_accepted_tokens"] < 6
    engine.abort_request("1")  # after a verification that wrote KV for its drafts
    while engine.has_unfinished_requests():
        engine.step()
    _free_everything(engine)


def test_sampled_requests_run_and_stay_seeded(tiny_models):
    """Sampled verification end to end: a seeded request gives the same tokens twice."""
    path = tiny_models["llama"]
    engine = build_engine(_with_spec(make_engine(path, block_size=4).config))
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=7, ignore_eos=True)
    prompt = _tiny_workload()[0][1]
    runs = [run_schedule(engine, [(0, prompt, params)])[0]["0"] for _ in range(2)]
    assert runs[0].outputs[0].token_ids == runs[1].outputs[0].token_ids
    assert len(runs[0].outputs[0].token_ids) == 30
    _free_everything(engine)


# ---- what it reports -----------------------------------------------------------------------


def test_spec_metrics_reach_prometheus_and_the_bench_report(tiny_models):
    from prometheus_client import generate_latest

    from kiln.bench.matrix import spec_decode_delta
    from kiln.bench.report import _run_notes
    from kiln.bench.runner import BenchSettings, RunResult
    from kiln.server.metrics import ServerMetrics

    engine = build_engine(_with_spec(make_engine(tiny_models["llama"], block_size=4).config))
    engine.speculator.pad_drafts = True
    before = engine.stats().spec_decode
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    run_schedule(engine, [(0, [5, 6, 7, 5, 6], params)])
    after = engine.stats().spec_decode
    text = generate_latest(ServerMetrics(engine, lambda: 0).registry).decode()
    drafted = after["num_draft_tokens"]
    assert drafted > 0 and f"kiln_spec_decode_num_draft_tokens_total {drafted:.1f}" in text
    assert 'kiln_spec_decode_num_accepted_tokens_per_pos_total{position="2"}' in text
    delta = spec_decode_delta(before, after)
    assert delta["num_draft_tokens"] == drafted
    assert delta["acceptance_rate"] == after["acceptance_rate"]
    run = RunResult("ngram", "http://x", "m", "r", BenchSettings(["regular"], [1000]))
    run.server = {"spec_decode": delta | {"method": "ngram"}}
    (line,) = [x for x in _run_notes(run) if "speculative" in x]
    assert line.startswith("- speculative decoding (ngram): acceptance")
    assert f"of {drafted} draft tokens" in line


def test_a_speculating_servers_streams_are_incremental_per_step():
    """Chunks of up to 1 + k tokens are a streaming server's steps, not a buffered answer."""
    from kiln.bench.trial import StreamRecord, invalid_reasons

    chunks = [(0.1 * i, f"word{i} ") for i in range(12)]  # 40 tokens in 12 chunks
    rec = StreamRecord(0.0, chunks, 100, 40, None, 40, 100, 5.0)
    assert "stream_not_incremental" in invalid_reasons(rec, text_checks=False)
    assert "stream_not_incremental" not in invalid_reasons(rec, False, tokens_per_step=4)
    rec.chunks = rec.chunks[:4]  # 10 tokens a chunk: buffered even for k = 3
    assert "stream_not_incremental" in invalid_reasons(rec, False, tokens_per_step=4)


def test_drafts_never_cost_another_sequence_its_step(tiny_models):
    """Two decoding sequences, a step budget of 4 tokens and k = 3: every step runs both (the
    first one's drafts take what the second one's token leaves), rather than the first one's
    drafts taking the whole budget and the second waiting."""
    engine = make_engine(tiny_models["llama"], block_size=4, max_num_batched_tokens=4)
    engine = build_engine(_with_spec(engine.config))
    engine.speculator.pad_drafts = True  # k drafts every step
    seen, schedule = [], engine.scheduler.schedule

    def recording():  # the real scheduler's batches, as the engine runs them
        batch = schedule()
        seen.append((set(engine.requests), [s.request_id for s in batch.seqs], batch.num_tokens))
        return batch

    engine.scheduler.schedule = recording
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", [8, 9], params)
    while engine.has_unfinished_requests():
        engine.step()
    both = [(ids, n) for live, ids, n in seen if live == {"a", "b"}]
    assert all(ids == ["a", "b"] for ids, _ in both), both
    assert any(n == [3, 1] for _, n in both)  # a: its token and 2 drafts; b: its token
    assert all(sum(n) <= 4 for _, _, n in seen)
    _free_everything(engine)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("kv", [2**20, 150 * 1024], ids=["roomy", "preempting"])
def test_hybrid_models_keep_no_rejected_draft_in_their_state(tiny_models, name, kv):
    """Gated DeltaNet layers: a verification step runs each sequence's 1 + k tokens through
    its state, keeping the state after each; where a draft is rejected the state after the
    last kept token is taken back, so greedy output and logits equal plain decoding (with a
    prefix hit and under preemption, every slot and block given back)."""
    kwargs = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=8, kv_cache_memory=kv,
                  max_model_len=64)  # fmt: skip
    reference = make_engine(tiny_models[name], **kwargs)
    want, want_logits = run_schedule(reference, _tiny_workload(), record_logits=True)
    engine = build_engine(_with_spec(reference.config, NGRAM | {"disable_by_batch_size": 8}))
    # drafts that are right up to a point: the plain run's next tokens, the third one wrong
    # every other step (a random model repeats too little for n-gram lookups to find them)
    steps = iter(range(10**6))

    def oracle(seq):
        room = min(3, seq.params.max_tokens - seq.num_output_tokens - 1)
        right = want[seq.request_id].outputs[0].token_ids[seq.num_output_tokens :][:room]
        if len(right) == 3 and next(steps) % 2:
            right[2] = (right[2] + 1) % 49152
        return right

    engine.speculator._drafts = oracle
    propose, behind = engine.speculator.propose, []

    def recording(running):  # a rejection leaves nothing to compute again
        behind.extend(s.num_uncomputed_tokens for s in running if s.num_output_tokens)
        propose(running)

    engine.speculator.propose = recording
    got, logits = run_schedule(engine, _tiny_workload(), record_logits=True)
    if kv == 2**20:  # without preemptions (which do recompute)
        assert behind and set(behind) == {1}
    for rid in want:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
        a, b = torch.stack(logits[rid]), torch.stack(want_logits[rid])
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
    st = engine.stats()
    spec = st.spec_decode
    assert spec["num_accepted_tokens"] > spec["num_draft_tokens"] / 2  # the state moved on
    assert spec["accepted_per_position"][2] < spec["num_drafts"]  # and went back
    if kv < 2**20:  # the per-position states come out of the budget: the KV runs short
        assert st.num_preemptions > 0
    else:  # a prefix hit, its state restored from a checkpoint of a speculating sequence
        assert got["4"].num_cached_tokens > 0
    assert engine.blocks.state_slots.num_free == 8
    _free_everything(engine)


def test_a_hybrids_accepted_drafts_leave_prefix_checkpoints(tiny_models):
    """A block end inside accepted drafts gets its Gated DeltaNet state checkpointed (from the
    verified run's per-token states), so a later prompt that repeats the generated text hits
    the prefix cache up to its last block, with the same tokens as without the hit."""
    kwargs = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=8, kv_cache_memory=2**20,
                  max_model_len=64)  # fmt: skip
    reference = make_engine(tiny_models["qwen3_next"], **kwargs)
    prompt = [11, 12, 13, 14, 15, 16]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want, _ = run_schedule(reference, [(0, prompt, params)])
    output = want["0"].outputs[0].token_ids
    follow_up = prompt + output[:12]
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    want_b, _ = run_schedule(reference, [(0, follow_up, short)])
    engine = build_engine(_with_spec(reference.config, NGRAM | {"disable_by_batch_size": 8}))
    # every draft right: the plain run's next tokens
    engine.speculator._drafts = lambda seq: output[seq.num_output_tokens :][:3]
    run_schedule(engine, [(0, prompt, params)])
    assert engine.stats().spec_decode["num_accepted_tokens"] >= 12
    got, _ = run_schedule(engine, [(0, follow_up, short)])
    assert got["0"].num_cached_tokens == 16  # the state at 8, 12 and 16 came from drafts
    assert got["0"].outputs[0].token_ids == want_b["0"].outputs[0].token_ids
