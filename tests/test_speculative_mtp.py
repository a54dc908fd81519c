"""Speculative decoding with the checkpoint's MTP head (`"method": "mtp"`), on the tiny hybrids
given a random head (tests/conftest.py: add_mtp_head): its drafts equal a slow reference
written from the checkpoint's tensors (HF's decoder layer for the head's layer, the whole
sequence recomputed at every step); greedy output equals plain decoding, eager and compiled,
under preemption; sampled requests accept the head's drafts at a high temperature and stay
seeded; its steps follow its own graph plan; nothing leaks; checkpoints without a head, or with
a head kiln does not run, are refused."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace

import pytest
import torch

from kiln import SamplingParams, build_engine
from kiln.config import CompilationConfig
from kiln.config.speculative import SpeculativeConfig
from kiln.cudagraphs.graph_backend import EmulatedGraphBackend
from kiln.errors import ConfigError
from tests.helpers import make_engine, run_schedule
from tests.test_speculative import _tiny_workload

KW = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64)


def _mtp(config, k: int = 3):
    return replace(config, speculative=SpeculativeConfig("mtp", k, disable_by_batch_size=8))


def _free_everything(engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.blocks.state_slots.num_free == engine.config.scheduler.max_num_seqs


def _zero_centred_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


class SlowMTP:
    """The head recomputed from scratch for a whole sequence at every draft: HF's model for
    the target's hidden states, HF's decoder layer loaded with the mtp.layers.0 tensors, and
    the fc projection and norms written out by hand."""

    def __init__(self, path: str, tmp: str) -> None:
        from safetensors.torch import load_file, save_file
        from transformers import AutoModelForCausalLM

        tensors = load_file(os.path.join(path, "model.safetensors"))
        self.mtp = {k.removeprefix("mtp."): v for k, v in tensors.items() if k.startswith("mtp.")}
        load = lambda p: AutoModelForCausalLM.from_pretrained(p, attn_implementation="eager")  # noqa: E731
        self.target = load(path).eval()
        # the head's layer: the target's full-attention layer (1) with the head's weights
        shutil.copytree(path, tmp)
        replaced = ("mtp.", "model.layers.1.")
        swapped = {k: v for k, v in tensors.items() if not k.startswith(replaced)}
        swapped |= {"model.layers.1." + k.removeprefix("layers.0."): v
                    for k, v in self.mtp.items() if k.startswith("layers.0.")}  # fmt: skip
        save_file(swapped, os.path.join(tmp, "model.safetensors"))
        self.layer = load(tmp).eval().model.layers[1]
        self.eps = self.target.config.rms_norm_eps

    @torch.no_grad()
    def draft_logits(self, tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
        """The head's logits for each draft of a sequence whose last token is not computed
        yet, chained on the given drafts."""
        model, m, eps = self.target.model, self.mtp, self.eps
        hidden = model(torch.tensor([tokens])).last_hidden_state[0, :-1]
        inputs, out = list(tokens[1:]), []
        for j in range(len(drafts)):
            embedded = _zero_centred_norm(model.embed_tokens(torch.tensor(inputs)),
                                          m["pre_fc_norm_embedding.weight"], eps)  # fmt: skip
            x = torch.cat([embedded, _zero_centred_norm(hidden, m["pre_fc_norm_hidden.weight"],
                                                        eps)], -1) @ m["fc.weight"].T  # fmt: skip
            n = x.shape[0]
            rope = model.rotary_emb(x[None], torch.arange(n)[None])
            causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
            y = self.layer(x[None], position_embeddings=rope, attention_mask=causal)[0]
            last = _zero_centred_norm(y[-1], m["norm.weight"], eps)
            out.append(self.target.lm_head(last))
            inputs.append(drafts[j])
            hidden = torch.cat([hidden, last[None]])
        return out


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_mtp_drafts_equal_a_slow_reference(mtp_models, tmp_path, name):
    """Every draft of a run (prompts in chunks, verification steps that kept part of their
    drafts, the hybrid's recomputed runs) is the argmax of the slow reference's logits; prefix
    caching off: a prefix hit reuses the head's KV entry at the hit's last position, written
    with the next token of the sequence that cached it."""
    engine = make_engine(mtp_models[name], prefix_caching=False, kv_cache_memory=2**20, **KW)
    engine = build_engine(_mtp(engine.config))
    seen: list[tuple[list[int], list[int]]] = []
    draft = engine.speculator.draft

    def recording(batch):
        draft(batch)
        seen.extend((list(s.token_ids), list(s.spec_token_ids)) for s in batch.seqs
                    if s.spec_token_ids)  # fmt: skip

    engine.speculator.draft = recording
    run_schedule(engine, _tiny_workload())
    assert len(seen) > 20
    reference = SlowMTP(mtp_models[name], str(tmp_path / "layer"))
    for tokens, drafts in seen[::3]:
        for j, logits in enumerate(reference.draft_logits(tokens, drafts)):
            gap = logits.max() - logits[drafts[j]]
            assert gap <= 1e-4 * logits.abs().max(), (len(tokens), j, gap)
    _free_everything(engine)


@pytest.mark.parametrize(
    ("name", "kv", "mode"),
    [("qwen3_next", 2**20, 0), ("qwen3_next", 150 * 1024, 0), ("qwen3_5", 2**20, 3)],
    ids=["experts", "experts-preempting", "dense-mode3"],
)
def test_mtp_greedy_output_is_unchanged(mtp_models, name, kv, mode):
    """With prefix hits, a request that stops inside its drafts, penalties, and preemption."""
    kwargs = dict(kv_cache_memory=kv, compilation=CompilationConfig(mode=mode), **KW)
    reference = make_engine(mtp_models[name], **kwargs)
    want, _ = run_schedule(reference, _tiny_workload())
    engine = build_engine(_mtp(reference.config, k=2))
    got, _ = run_schedule(engine, _tiny_workload())
    for rid in want:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
    st = engine.stats()
    assert st.spec_decode["num_drafts"] > 20
    assert st.spec_decode["draft_graphs"]["recompilations"] == 0
    if kv < 2**20:
        assert st.num_preemptions > 0
    _free_everything(engine)


def test_mtp_drafts_are_accepted_when_sampling_hot(mtp_models):
    """At temperature 50 the target's and the head's distributions are both near uniform, so
    min(1, p/q) accepts most drafts: the chained steps and the hybrid's state move on past
    accepted drafts; the same seeds give the same tokens on a second engine."""
    engine = make_engine(mtp_models["qwen3_next"], kv_cache_memory=2**20, **KW)
    config = _mtp(engine.config, k=2)
    hot = SamplingParams(temperature=50.0, max_tokens=20, ignore_eos=True, seed=7)
    arrivals = [(t, p, replace(hot, seed=i)) for i, (t, p, _) in enumerate(_tiny_workload())]
    runs = []
    for _ in range(2):
        engine = build_engine(config)
        finals, _ = run_schedule(engine, arrivals)
        runs.append({rid: f.outputs[0].token_ids for rid, f in finals.items()})
        st = engine.stats().spec_decode
        assert st["acceptance_rate"] > 0.5, st
        assert st["accepted_per_position"][1] > 0
        _free_everything(engine)
    assert runs[0] == runs[1]
    assert all(len(tokens) == 20 for tokens in runs[0].values())


@pytest.mark.parametrize(
    ("graph_mode", "mode", "backend"),
    [
        ("PIECEWISE", 3, "torch"),
        ("FULL_AND_PIECEWISE", 3, "triton"),
        ("FULL_DECODE_ONLY", 0, "triton"),
    ],
)
def test_mtp_steps_follow_their_own_graph_plan(mtp_models, graph_mode, mode, backend):
    """On the emulated graph backend: the target verifies runs of 1 + k tokens, the head
    catches up and chains in graphs of its own plan (its chained steps are one-token decodes);
    no misses for either, eager's tokens."""
    from tests.test_graphs import _engine, _workload

    path = mtp_models["qwen3_next"]
    eager = _engine(path, "NONE", 0, backend, graphs=False, kv=2**20)
    want, _ = run_schedule(eager, _workload())
    base = _engine(path, graph_mode, mode, backend, kv=2**20)
    config = _mtp(base.config, k=2)
    base.close()
    engine = build_engine(config, graph_backend=EmulatedGraphBackend())
    got, _ = run_schedule(engine, _workload())
    for rid in want:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
    st = engine.stats()
    assert st.spec_decode["num_drafts"] > 0
    decode = engine.plan.decode_mode.value
    assert st.graphs["graph_misses"] == 0 and st.graphs["steps"][decode] > 0
    head = st.spec_decode["draft_graphs"]
    assert head["graph_misses"] == 0 and head["steps"][decode] > 0, head
    _free_everything(engine)


def test_checkpoints_without_a_head_kiln_runs_are_refused(tiny_models, mtp_models, tmp_path):
    from safetensors.torch import load_file, save_file

    plain = make_engine(tiny_models["qwen3_next"], kv_cache_memory=2**20)
    with pytest.raises(ConfigError, match="has none"):
        build_engine(_mtp(plain.config))
    two_layers = str(tmp_path / "two")
    shutil.copytree(mtp_models["qwen3_next"], two_layers)
    file = os.path.join(two_layers, "model.safetensors")
    tensors = load_file(file)
    tensors["mtp.layers.1.input_layernorm.weight"] = torch.zeros(64)
    save_file(tensors, file)
    config = replace(plain.config, model=two_layers)
    with pytest.raises(ConfigError, match="2 decoder layers"):
        build_engine(_mtp(config))


def test_the_heads_trace_is_saved_beside_the_targets(mtp_models, tmp_path, monkeypatch):
    """Mode 3: the drafter's Dynamo trace lies in the target's compile cache entry, so a second
    boot loads both instead of tracing them again, and decodes the same tokens."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    kwargs = dict(kv_cache_memory=2**20, compilation=CompilationConfig(mode=3), **KW)
    config = _mtp(make_engine(mtp_models["qwen3_next"], **kwargs).config, k=2)
    traces, tokens = [], []
    for _ in range(2):
        engine = build_engine(config)
        finals, _ = run_schedule(engine, _tiny_workload()[:2])
        tokens.append({rid: f.outputs[0].token_ids for rid, f in finals.items()})
        head = engine.speculator.draft_model.runner
        traces.append((engine.runner.compile_stats()["dynamo_trace"],
                       head.compile_stats()["dynamo_trace"]))  # fmt: skip
        assert engine.stats().spec_decode["draft_graphs"]["recompilations"] == 0
        engine.close()
    assert traces == [("traced and saved", "traced and saved"), ("loaded", "loaded")]
    assert tokens[0] == tokens[1]
