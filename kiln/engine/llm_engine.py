"""The engine loop: requests in, one scheduled batch per step, outputs out. The engine owns the
scheduler, the block manager and the requests; it runs a model through a ModelExecutor that
kiln.boot built for it (`kiln.build_engine(config)`)."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.compile_cache.entry import CompileCacheEntry
from kiln.config.engine import EngineConfig
from kiln.config.graph_plan import GraphPlan, RuntimeMode
from kiln.cudagraphs.graph_backend import CaptureStats
from kiln.engine.block_manager import BlockManager
from kiln.engine.executor import ModelExecutor, SampledTokens
from kiln.engine.heap import unfreeze_heap
from kiln.engine.output_processor import OutputProcessor
from kiln.engine.request import Request, new_sequences, validate_prompt
from kiln.engine.scheduler import Scheduler
from kiln.engine.sequence import Sequence, SequenceCounter
from kiln.engine.state_checkpoints import StateCheckpoints, num_state_checkpoints
from kiln.engine.state_slots import StateSlots
from kiln.errors import EngineClosedError, InvalidRequestError
from kiln.loader.tokenizer import Tokenizer
from kiln.models.config import ModelConfig
from kiln.outputs import RequestMetrics, RequestOutput
from kiln.sampling_params import SamplingParams
from kiln.spec.speculator import Speculator


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_steps: int
    graphs: dict = field(default_factory=dict)  # runtime-mode step counts, graph misses
    spec_decode: dict | None = None  # SpecDecodeStats.to_dict(), when speculating

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0


@dataclass
class BootReport:
    """How the engine was built, as the boot measured it: for /v1/engine and `kiln info`."""

    model_path: str
    device: torch.device
    attention_backend: str
    attention_graph_support: str
    attention_kernels: str = ""  # the backend's describe(): which kernels it took here
    phases_s: dict[str, float] = field(default_factory=dict)  # seconds per boot phase
    boot_s: float = 0.0
    compile_cache: CompileCacheEntry | None = None  # the entry mode 3 compiled into or loaded
    capture: CaptureStats = field(default_factory=CaptureStats)  # graphs, time, memory


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        runner: ModelExecutor,
        num_blocks: int,
        max_model_len: int,
        boot: BootReport,
    ) -> None:
        """Built by kiln.boot.builder.build_engine, which loads the model, sizes the KV cache
        (`num_blocks`) and hands over the runner."""
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        self.runner, self.max_model_len, self.boot = runner, max_model_len, boot
        cache = config.cache
        hybrid = model_config.is_hybrid
        slots = StateSlots(config.scheduler.max_num_seqs) if hybrid else None
        checkpoints = num_state_checkpoints(config, hybrid)
        self.blocks = BlockManager(
            num_blocks, cache.block_size, cache.enable_prefix_caching, slots,
            StateCheckpoints(checkpoints) if checkpoints else None,
        )  # fmt: skip
        self.scheduler = Scheduler(config.scheduler, self.blocks)
        self.output_processor = OutputProcessor(tokenizer, max_model_len)
        self.requests: dict[str, Request] = {}
        self.closed = False
        self.seq_ids = SequenceCounter()
        self.num_steps = 0
        spec = config.speculative
        self.speculator = (
            Speculator(spec, max_model_len, self._uniform_verification())
            if spec is not None
            else None
        )

    def _uniform_verification(self) -> bool:
        """Whether verification batches must stay uniform: FULL decode graphs of 1 + k tokens
        per sequence (with decode rows of one position each, any mix is uniform)."""
        plan = self.plan
        return plan.decode_mode is RuntimeMode.FULL and plan.uniform_decode_query_len > 1

    @property
    def plan(self) -> GraphPlan:
        """The graph plan the runner executes (after boot fitted it to memory)."""
        return self.runner.plan

    @property
    def device(self) -> torch.device:
        return self.boot.device

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        params = params or SamplingParams()
        text, ids = self.prepare_prompt(prompt, params)
        self.add_prepared(request_id, text, ids, params, arrival_time)

    def prepare_prompt(
        self, prompt: str | list[int], params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """Tokenize and validate. Touches no engine state, so a server can call it from its
        request handlers while the engine loop runs."""
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        validate_prompt(ids, params, self.model_config.vocab_size, self.max_model_len)
        return text, ids

    def add_prepared(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        if self.closed:
            raise EngineClosedError("this engine was closed: build a new one to run requests")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        metrics = RequestMetrics(arrival_time or time.monotonic())
        seqs = new_sequences(
            request_id, ids, params, metrics, self.tokenizer.backend, self.device, self.seq_ids
        )
        self.requests[request_id] = Request(request_id, text, ids, params, seqs, metrics)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks. Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        return request.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:
        """Free the KV cache and the captured graphs now rather than whenever the garbage
        collector gets to them: an engine built next in this process sizes its KV cache from
        the device memory left free. Unfinished requests are dropped. The objects boot froze
        out of the collector's passes (kiln/engine/heap.py) are given back to it first."""
        self.closed = True
        self.requests.clear()
        self.runner.release_memory()
        if self.speculator is not None and self.speculator.draft_model is not None:
            self.speculator.draft_model.release_memory()
        unfreeze_heap()
        gc.collect()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        for seq, n in zip(batch.seqs, batch.num_tokens):  # a state checkpoint: known tokens only
            self.blocks.plan_checkpoint(seq, n - len(seq.spec_token_ids))
        if self.speculator is not None:
            self.speculator.draft(batch)
        start = time.perf_counter()
        sampled = self.runner.execute(batch)
        rejected = self._rejected(sampled, time.perf_counter() - start)
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n - rejected.get(seq, 0)
            seq.draft_computed = min(seq.draft_computed, seq.num_computed_tokens)
            if seq.spec_token_ids:
                seq.spec_token_ids, seq.spec_probs = [], None
                self.blocks.trim(seq)
            self.blocks.register_computed_blocks(seq)
        self.num_steps += 1
        if self.speculator is not None:  # an MTP head runs over what the target kept
            new_tokens = dict(zip(sampled.seqs, sampled.token_ids))
            self.speculator.follow(batch.seqs, starts, new_tokens, self.runner.last_step)
            self.runner.last_step = None  # its hidden states: not held through the next step
        self._append(sampled)
        outputs = []
        for request_id in dict.fromkeys(s.request_id for s in sampled.seqs):
            request = self.requests[request_id]
            outputs.append(request.output())
            if request.finished:
                del self.requests[request_id]
        return outputs

    def _rejected(self, sampled: SampledTokens, seconds: float) -> dict[Sequence, int]:
        """The drafts each sequence lost (their KV is rolled back), and the statistics."""
        if sampled.num_drafts is None:
            return {}
        lost = [sampled.num_rejected(i) for i in range(len(sampled.seqs))]
        self.speculator.record(sampled.num_drafts, lost, seconds)
        return dict(zip(sampled.seqs, lost))

    def _append(self, sampled: SampledTokens) -> None:
        now = time.monotonic()
        for i, (seq, tokens) in enumerate(zip(sampled.seqs, sampled.token_ids)):
            for j, token in enumerate(tokens):
                if self.output_processor.append(seq, token, sampled.logprob_row(i, j), now):
                    self.scheduler.finish(seq)
                    break
            else:
                if len(tokens) > 1:  # the accepted drafts' full blocks, and a hybrid's state
                    self.blocks.register_computed_blocks(seq)
                    saved = self.blocks.checkpoint_in_accepted(seq, len(tokens))
                    if saved is not None:
                        self.runner.states.save_verified(seq, *saved)

    def forget_warm_up(self) -> None:
        """After the boot's warm-up requests: an empty prefix cache, no steps counted."""
        self.blocks.reset_prefix_cache()
        self.runner.reset_counters()
        self.num_steps = 0
        if self.speculator is not None:
            self.speculator.reset()

    # ---- what it reports ------------------------------------------------------------------

    def stats(self) -> EngineStats:
        b = self.blocks
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=b.num_free_blocks,
            num_blocks=b.num_blocks,
            kv_cache_usage=b.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queried_tokens=b.stats.queried_tokens,
            prefix_cache_hit_tokens=b.stats.hit_tokens,
            num_steps=self.num_steps,
            graphs=self.runner.graph_stats(),
            spec_decode=self.speculator.report() if self.speculator else None,
        )

    def describe(self) -> dict[str, Any]:
        """What the engine resolved (graph plan, compilation, capture, boot) and its live
        stats: `/v1/engine`."""
        st, boot = self.stats(), self.boot
        return {
            "model": boot.model_path,
            "model_config": self.model_config.to_dict(),
            "max_model_len": self.max_model_len,
            "device": str(boot.device),
            "dtype": self.config.dtype,
            "scheduler": vars(self.config.scheduler),
            "cache": vars(self.config.cache),
            "attention_backend": {
                "name": boot.attention_backend,
                "kernels": boot.attention_kernels,
                "graph_support": boot.attention_graph_support,
            },
            "graph_plan": self.plan.to_dict(),
            "speculative_config": spec.to_dict() if (spec := self.config.speculative) else None,
            "compile_cache": boot.compile_cache.to_dict() if boot.compile_cache else None,
            "compilation": self.runner.compile_stats(),
            "boot": {**{f"{k}_s": v for k, v in boot.phases_s.items()}, "boot_s": boot.boot_s},
            "capture": boot.capture.to_dict(),
            "stats": {**vars(st), "prefix_cache_hit_rate": st.prefix_cache_hit_rate},
            "num_blocks": st.num_blocks,
            "num_free_blocks": st.num_free_blocks,
        }
