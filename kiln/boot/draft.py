"""The draft model of `"method": "draft_model"`, built beside the target: loaded and checked
against the target's vocabulary, given a graph plan by the same rules (a redirect the target
gets, the drafter gets too, with its own batch descriptors: its decode steps are 1-token
batches), its own runner, and a KV cache of the target's block count out of the same budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from kiln.attention.backend import AttentionBackend
from kiln.boot.capture import GraphCapture, graph_backend_for
from kiln.boot.kv_cache import kv_bytes_per_block
from kiln.boot.preview import resolve_plan, select_attention, torch_dtype
from kiln.config.engine import EngineConfig
from kiln.cudagraphs.graph_backend import GraphBackend
from kiln.errors import ConfigError
from kiln.loader import ModelSource, open_model
from kiln.loader.tokenizer import Tokenizer
from kiln.models.config import ModelConfig
from kiln.runner.draft import DraftModelProposer
from kiln.runner.input_buffers import InputBuffers
from kiln.runner.model_runner import ModelRunner, Sampling
from kiln.runner.padding import pads_eager_steps

logger = logging.getLogger(__name__)


@dataclass
class LoadedDraft:
    source: ModelSource
    backend: AttentionBackend
    model: torch.nn.Module
    runner: ModelRunner | None = None


def load_draft(config: EngineConfig, target: ModelConfig, device: torch.device, load_model):
    """The draft model loaded (`load_model`: the builder's), or None without one."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return None
    source = open_model(spec.model)
    draft = source.config
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"the draft model {spec.model} has a vocabulary of {draft.vocab_size} tokens, the "
            f"target {target.vocab_size}: a draft model must share the target's tokenizer"
        )
    if draft.is_hybrid:
        raise ConfigError(f"the draft model {spec.model} is a hybrid model, which cannot draft")
    own = _own_config(config)
    backend = select_attention(own, draft, device)
    logger.info("draft model: %s (%s)", source.path, draft.architecture)
    return LoadedDraft(source, backend, load_model(source, backend, own, device))


def _own_config(config: EngineConfig) -> EngineConfig:
    """The config the draft runs under: the target's, without speculation."""
    return replace(config, speculative=None)


def build_draft_runner(
    draft: LoadedDraft,
    config: EngineConfig,
    max_model_len: int,
    tokenizer: Tokenizer,
    device: torch.device,
    graph_backend: GraphBackend | None,
) -> ModelRunner:
    own = _own_config(config)
    plan = resolve_plan(own, draft.backend, device, graph_backend, draft.source.config)
    sched, block_size = own.scheduler, own.cache.block_size
    buffers = InputBuffers(sched.max_num_batched_tokens, sched.max_num_seqs,
                           -(-max_model_len // block_size), block_size, device)  # fmt: skip
    sampling = Sampling(draft.source.config.vocab_size, tokenizer.eos_token_ids, own.seed)
    runner = ModelRunner(draft.model, draft.backend, plan, buffers, sampling, device, None,
                         "the draft model's trace is not saved: traced at every boot")  # fmt: skip
    runner.pad_eager_steps = pads_eager_steps(own.eager_step_padding, device.type)
    runner.attach_graphs(graph_backend_for(plan, device, graph_backend))
    draft.runner = runner
    return runner


def draft_bytes_per_block(draft: LoadedDraft | None, config: EngineConfig) -> int:
    if draft is None:
        return 0
    return kv_bytes_per_block(draft.source.config, config.cache.block_size, torch_dtype(config))


def finish_draft(draft: LoadedDraft, config: EngineConfig, num_blocks: int, generator_seed: int):
    """The draft runner's KV cache on the target's block count, and its proposer."""
    runner = draft.runner
    runner.allocate_kv_cache(num_blocks, torch_dtype(config))
    generator = torch.Generator(runner.device).manual_seed(generator_seed + 1)
    budget = config.scheduler.max_num_batched_tokens
    return DraftModelProposer(runner, budget, runner.sampling.eos_token_ids, generator)


def capture_draft_graphs(draft: LoadedDraft | None) -> None:
    if draft is not None:
        GraphCapture(draft.runner).capture()
