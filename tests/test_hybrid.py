"""Hybrid models (Qwen3-Next: Gated DeltaNet layers beside attention layers) in the engine:
state slots taken and given back with a sequence's blocks (preemption and abort leak none, and
a preempted sequence recomputed into a fresh slot gives the same tokens), the state memory
sized beside the KV cache, prefix hits starting from the saved state, mode 3 and graphs equal
to eager (FULL captured with the Triton core, resolved loudly with the PyTorch one). HF parity is in
test_parity.py, the delta rule in test_gdn.py."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln import SamplingParams
from kiln.boot.kv_cache import state_bytes_per_sequence
from kiln.config import CompilationConfig
from kiln.engine.state_checkpoints import StateCheckpoints
from kiln.engine.state_slots import StateSlots
from kiln.loader import open_model
from tests.helpers import make_engine, run_schedule


def _workload():
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49000, (n,), generator=g).tolist() for n in (7, 30, 12, 45, 3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [(t, p, params) for t, p in zip([0, 0, 1, 2, 4], prompts)]


def test_preempted_sequences_recompute_into_fresh_slots(tiny_models):
    """A KV budget that forces preemption: the same greedy tokens as with room for all, and
    every slot free at the end."""
    path = tiny_models["qwen3_next"]
    roomy = make_engine(path, block_size=4, max_num_batched_tokens=16, prefix_caching=False)
    tight = make_engine(path, block_size=4, max_num_batched_tokens=16, prefix_caching=False,
                        kv_cache_memory=_kv_bytes(path, 64) + _state_bytes(path, 16),
                        max_model_len=64)  # fmt: skip
    expected, _ = run_schedule(roomy, _workload())
    got, _ = run_schedule(tight, _workload())
    assert tight.stats().num_preemptions > 0
    for rid, out in expected.items():
        assert got[rid].outputs[0].token_ids == out.outputs[0].token_ids
    for engine in (roomy, tight):
        slots = engine.blocks.state_slots
        assert slots.num_free == slots.num_slots == 16


def test_preemption_with_prefix_caching_gives_the_same_tokens(tiny_models):
    """Preempted sequences come back through their own cached blocks and saved states."""
    path = tiny_models["qwen3_next"]
    roomy = make_engine(path, block_size=4, max_num_batched_tokens=16, prefix_caching=False)
    tight = make_engine(path, block_size=4, max_num_batched_tokens=16, max_model_len=64,
                        kv_cache_memory=_kv_bytes(path, 64) + _state_bytes(path, 32))  # fmt: skip
    expected, _ = run_schedule(roomy, _workload())
    got, _ = run_schedule(tight, _workload())
    assert tight.stats().num_preemptions > 0
    assert tight.stats().prefix_cache_hit_tokens > 0  # some came back through a hit
    for rid, out in expected.items():
        assert got[rid].outputs[0].token_ids == out.outputs[0].token_ids


def _kv_bytes(path: str, tokens: int) -> int:
    cfg = open_model(path).config
    return tokens * len(cfg.attention_layer_ids) * 2 * cfg.num_kv_heads * cfg.head_dim * 4


def _state_bytes(path: str, seqs: int) -> int:
    return seqs * state_bytes_per_sequence(open_model(path).config, torch.float32)


def test_the_state_bytes_are_the_layers_state_shapes(tiny_models):
    cfg = open_model(tiny_models["qwen3_next"]).config
    la = cfg.linear_attention
    conv = (2 * 2 * 16 + 4 * 8) * (4 - 1) * 4  # (q, k, v channels) x (kernel - 1) x fp32
    recurrent = 4 * 16 * 8 * 4  # value heads x key dim x value dim x fp32
    assert la.state_bytes(torch.float32) == conv + recurrent
    assert state_bytes_per_sequence(cfg, torch.float32) == len(cfg.linear_layer_ids) * (
        conv + recurrent
    )
    assert cfg.linear_layer_ids == (0,) and cfg.attention_layer_ids == (1,)


def test_an_abort_gives_the_slot_back(tiny_models):
    engine = make_engine(tiny_models["qwen3_next"], prefix_caching=False, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, [5, 6, 7, 8], params)
    engine.step()
    slots = engine.blocks.state_slots
    assert slots.num_free == 0 and len(engine.scheduler.waiting) == 1  # c waits for a slot
    engine.abort_request("a")
    assert slots.num_free == 1
    engine.step()  # c takes a's slot and starts from an empty state
    assert slots.num_free == 0
    for rid in ("b", "c"):
        engine.abort_request(rid)
    assert slots.num_free == 2


def test_slots_refuse_a_double_give_back():
    slots = StateSlots(2)
    a = slots.take()
    slots.give_back(a)
    with pytest.raises(RuntimeError, match="given back twice"):
        slots.give_back(a)


def test_a_prefix_hit_starts_from_the_saved_state(tiny_models):
    """The same 45-token prompt twice, the second after the first has finished: the second
    hits the prefix cache up to the last block end whose state was saved (the first's chunks
    of 16 end at 16, 32 and 45: block ends 16 and 32 with bs 8 and chunk 16), and its greedy
    tokens and logits equal the first's."""
    engine = make_engine(tiny_models["qwen3_next"], block_size=8, max_num_batched_tokens=16)
    prompt = _workload()[3][1]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first, first_logits = run_schedule(engine, [(0, prompt, params)], record_logits=True)
    again, again_logits = run_schedule(engine, [(0, prompt, params)], record_logits=True)
    assert first["0"].num_cached_tokens == 0 and again["0"].num_cached_tokens == 40
    assert again["0"].outputs[0].token_ids == first["0"].outputs[0].token_ids
    a, b = torch.stack(again_logits["0"]), torch.stack(first_logits["0"])
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
    slots = engine.blocks.state_slots
    assert slots.num_free == slots.num_slots


def test_checkpoints_are_a_bounded_lru_pool():
    pool = StateCheckpoints(2)
    a, b = pool.reserve(111), pool.reserve(222)
    assert {a, b} == {0, 1} and pool.lookup(111) == a  # 111 now the most recently used
    c = pool.reserve(333)  # evicts 222, the least recently used
    assert c == b and pool.lookup(222) is None and pool.lookup(111) == a and len(pool) == 2
    pool.clear()
    assert pool.lookup(111) is None and len(pool) == 0


def _assert_same(engine, reference) -> None:
    ref, ref_logits = reference
    finals, logits = run_schedule(engine, _workload(), record_logits=True)
    for rid in ref:
        assert finals[rid].outputs[0].token_ids == ref[rid].outputs[0].token_ids
        a, b = torch.stack(logits[rid]), torch.stack(ref_logits[rid])
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


@pytest.fixture(scope="module")
def eager_reference(tiny_models):
    engine = make_engine(tiny_models["qwen3_next"], block_size=4, max_num_batched_tokens=16,
                         prefix_caching=False)  # fmt: skip
    return run_schedule(engine, _workload(), record_logits=True)


def _engine(path: str, compilation: CompilationConfig, **kw):
    """Prefix caching on: the workload shares no prefix, but every step saves states."""
    return make_engine(path, block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
                       compilation=compilation, **kw)  # fmt: skip


def test_mode_3_equals_eager(tiny_models, eager_reference):
    """One Inductor graph, the Gated DeltaNet op inside as an extern call."""
    engine = _engine(tiny_models["qwen3_next"], CompilationConfig(mode=3))
    _assert_same(engine, eager_reference)
    assert engine.runner.compile_stats()["compilations"] == 1


def test_the_per_token_state_rows_key_the_saved_trace(tiny_models, tmp_path, monkeypatch, caplog):
    """Speculation gives a hybrid's runner k state rows for each sequence that may verify in a
    step (at most disable_by_batch_size of them), inputs of fixed size to the compiled forward:
    limits 2 and 4 each get a trace of their own, and a boot with 2 again loads its own (the
    rows were once set after the trace file was named, so both limits shared one trace)."""
    from kiln.config.speculative import SpeculativeConfig

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    traces = []
    with caplog.at_level(logging.WARNING):
        for limit in (2, 4, 2):
            spec = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2,
                                                "prompt_lookup_min": 1,
                                                "disable_by_batch_size": limit})  # fmt: skip
            engine = _engine(tiny_models["qwen3_next"], CompilationConfig(mode=3), speculative=spec)
            assert engine.runner.states.position_rows == 2 * limit
            run_schedule(engine, _workload()[:2])
            traces.append(engine.runner.compile_stats()["dynamo_trace"])
            assert engine.stats().graphs["recompilations"] == 0
            engine.close()
    assert traces == ["traced and saved", "traced and saved", "loaded"]
    assert not [r for r in caplog.records if "guard" in r.getMessage()]


def test_mode_3_without_a_saved_trace_equals_eager(
    tiny_models, eager_reference, tmp_path, monkeypatch
):
    """Dynamo's own trace (`"aot_compile": false`, and every retrace after a saved guard
    failed) hands Inductor unbacked token counts, where a saved trace's graph has backed ones:
    Inductor once turned the output norm's flattening reshape into a guard that the token count
    is 1 and crashed the boot with "Guard failed on the same frame it was created". A fresh
    cache, so Inductor lowers the graph here and not from an earlier test's cache."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    engine = _engine(tiny_models["qwen3_next"], CompilationConfig(mode=3, aot_compile=False))
    _assert_same(engine, eager_reference)
    assert engine.stats().graphs["recompilations"] == 0


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL"])
def test_full_graphs_capture_the_triton_core(tiny_models, eager_reference, mode):
    """With the Triton attention backend the Gated DeltaNet layers take the Triton core, whose
    launches depend on the token count only: FULL stays FULL (decode steps, and with FULL every
    step, replay whole-forward graphs), the pieces split at attention and at that core, and the
    tokens and logits equal the CPU backend's eager run with the PyTorch core."""
    pytest.importorskip("triton")
    from kiln.cudagraphs.graph_backend import EmulatedGraphBackend

    config = CompilationConfig(mode=3, cudagraph_mode=mode,
                               cudagraph_capture_sizes=(1, 2, 4, 8, 16))  # fmt: skip
    engine = _engine(tiny_models["qwen3_next"], config, attention_backend="triton",
                     graph_backend=EmulatedGraphBackend())  # fmt: skip
    assert engine.plan.cudagraph_mode.value == mode
    pieces = mode == "FULL_AND_PIECEWISE"  # FULL alone compiles one graph, no split
    assert ("kiln::gdn_core_triton" in engine.plan.splitting_ops) == pieces
    _assert_same(engine, eager_reference)
    st = engine.stats()
    replayed = {m for m, n in st.graphs["steps"].items() if n}
    assert replayed == ({"FULL", "PIECEWISE"} if mode == "FULL_AND_PIECEWISE" else {"FULL"})
    assert st.graphs["graph_misses"] == 0
    layers = engine.model_config.num_layers  # one splitting op each: GDN or attention
    assert engine.runner.compile_stats()["pieces"] == (layers + 1 if pieces else 1)
    assert engine.blocks.state_slots.num_free == engine.blocks.state_slots.num_slots


def test_the_pytorch_core_resolves_full_to_piecewise_loudly(tiny_models):
    """The PyTorch core reads the batch on the host, so a plan whose attention could be
    captured whole still cannot capture its layers: FULL is resolved to PIECEWISE with a
    warning that names the Gated DeltaNet op (strict: an error)."""
    from kiln.boot.preview import device_caps, mixer_caps
    from kiln.config.graph_plan import GraphSupport, resolve_graph_plan
    from kiln.cudagraphs.graph_backend import EmulatedGraphBackend
    from kiln.errors import ConfigError
    from kiln.loader import open_model

    class FullCapable:  # an attention backend that FULL graphs capture, beside the PyTorch core
        name, graph_support, splitting_ops, state_core = "full", GraphSupport.ALWAYS, (), "torch"

    caps = mixer_caps(FullCapable(), open_model(tiny_models["qwen3_next"]).config)
    assert caps.graph_support == GraphSupport.NEVER and "kiln::gdn_core" in caps.splitting_ops
    device = device_caps(torch.device("cpu"), EmulatedGraphBackend())
    kw = dict(max_num_batched_tokens=16, max_num_seqs=8, uniform_decode_query_len=1,
              enforce_eager=False)  # fmt: skip
    config = CompilationConfig(mode=3, cudagraph_mode="FULL")
    plan = resolve_graph_plan(config, device, caps, strict=False, **kw)
    assert plan.cudagraph_mode.value == "PIECEWISE"  # boot logs each change as a WARNING
    assert any("Gated DeltaNet op (torch)" in c.message() for c in plan.changes)
    with pytest.raises(ConfigError):
        resolve_graph_plan(config, device, caps, strict=True, **kw)


def test_the_server_streams_a_hybrid_model(tiny_models):
    """`kiln serve` with the tiny Qwen3-Next: a repeated prompt is a prefix hit (usage says
    so) with the same answer, and a streamed answer equals the one-shot ones."""
    import json

    import httpx

    from tests.server_helpers import ServerProcess

    server = ServerProcess(tiny_models["qwen3_next"], "--kv-cache-memory", "16MiB")
    try:
        prompt = " ".join(["The lighthouse keeper wrote a long letter to the sea."] * 6)
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        url = server.base + "/v1/completions"
        first = httpx.post(url, json=body, timeout=60).json()
        again = httpx.post(url, json=body, timeout=60).json()
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as resp:
            lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        streamed = "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1])
        assert first["choices"][0]["text"] == again["choices"][0]["text"] == streamed
        assert first["usage"]["completion_tokens"] == 12
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        info = httpx.get(server.base + "/v1/engine", timeout=30).json()
        assert info["stats"]["num_running"] == 0
    finally:
        assert server.stop() == 0


def test_mtp_tensors_are_kept_for_the_head_and_freed_without_it(tiny_models, tmp_path):
    """A checkpoint with a multi-token-prediction head (mtp.*, as Qwen3-Next ships it): the load
    keeps its tensors on the model, byte for byte, for speculative decoding; an engine that does
    not speculate with it gives their memory back."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kiln.attention.torch_backend import TorchPagedAttentionBackend
    from kiln.loader import open_model
    from kiln.models import build_model
    from kiln.models.weights import load_weights

    path = tmp_path / "with_mtp"
    shutil.copytree(tiny_models["qwen3_next"], path)
    tensors = load_file(str(path / "model.safetensors"))
    mtp = {"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.randn(64)}
    save_file({**tensors, **mtp}, str(path / "model.safetensors"))
    source = open_model(str(path))
    model = build_model(source.config, TorchPagedAttentionBackend(torch.float32))
    load_weights(model, source.tensors(torch.float32))
    kept = model.mtp_weights
    assert set(kept) == set(mtp) and all(torch.equal(kept[k], mtp[k]) for k in mtp)
    engine = make_engine(str(path), prefix_caching=False)
    assert engine.runner.model.mtp_weights == {}


def test_a_saved_trace_serves_only_the_state_pool_it_was_traced_with(
    tiny_models, tmp_path, monkeypatch, caplog
):
    """Prefix caching on and off give the state-checkpoint pool different sizes, which Dynamo's
    saved trace guards on, and so does the thread count: each gets a trace of its own in the
    compile cache entry, so a later boot loads the right one instead of failing its guards
    every step (found as a mode-3 engine three times slower than a fresh one) or crashing in
    the retrace."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    path = tiny_models["qwen3_next"]
    traces, threads = [], torch.get_num_threads()
    try:
        with caplog.at_level(logging.WARNING):
            # the thread count is in Dynamo's global-state guard too: a trace saved with two
            # threads failed its guards under one, and the retrace crashed for this model
            for prefix_caching, n in ((True, 2), (False, 2), (True, 2), (False, 2), (True, 1)):
                torch.set_num_threads(n)
                engine = _engine(path, CompilationConfig(mode=3), prefix_caching=prefix_caching)
                run_schedule(engine, _workload()[:2])
                traces.append(engine.runner.compile_stats()["dynamo_trace"])
                assert engine.stats().graphs["recompilations"] == 0
                engine.close()
    finally:
        torch.set_num_threads(threads)
    saved, loaded = "traced and saved", "loaded"
    assert traces == [saved, saved, loaded, loaded, saved]
    assert not [r for r in caplog.records if "guard" in r.getMessage()]
