"""The drafter of `"method": "draft_model"` (a second model, loaded and checked against the
target's vocabulary) or `"mtp"` (the checkpoint's MTP head, built on the target's embedding and
LM head), built beside the target: given a graph plan by the same rules (a redirect the target
gets, the drafter gets too, with its own batch descriptors: its decode steps are 1-token
batches), its own runner, and a KV cache of the target's block count out of the same budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kiln.attention.backend import AttentionBackend
from kiln.boot.capture import GraphCapture, graph_backend_for
from kiln.boot.cpu_linears import lay_out_cpu_linears
from kiln.boot.kv_cache import kv_bytes_per_block
from kiln.boot.preview import kv_dtype, resolve_plan, select_attention, torch_dtype
from kiln.config.engine import EngineConfig
from kiln.cudagraphs.graph_backend import GraphBackend
from kiln.errors import ConfigError
from kiln.loader import open_model
from kiln.loader.tokenizer import Tokenizer
from kiln.models import build_on
from kiln.models.config import ModelConfig
from kiln.models.mtp import MTPHead, mtp_config
from kiln.models.weights import load_weights, weight_summary
from kiln.runner.draft import DraftModelProposer
from kiln.runner.input_buffers import InputBuffers
from kiln.runner.model_runner import ModelRunner, Sampling
from kiln.runner.mtp import MTPProposer
from kiln.runner.padding import pads_eager_steps

logger = logging.getLogger(__name__)


@dataclass
class LoadedDraft:
    config: ModelConfig
    backend: AttentionBackend
    model: torch.nn.Module
    runner: ModelRunner | None = None


def load_draft(config: EngineConfig, target_model, device: torch.device, load_model):
    """The drafter loaded (`load_model`: the builder's), or None without one."""
    spec = config.speculative
    if spec is not None and spec.method == "mtp":
        return _mtp_head(config, target_model, device)
    getattr(target_model, "mtp_weights", {}).clear()  # the head is not used: its memory back
    if spec is None or spec.method != "draft_model":
        return None
    target = target_model.config
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
    return LoadedDraft(draft, backend, load_model(source, backend, own, device))


def _mtp_head(config: EngineConfig, target_model, device: torch.device) -> LoadedDraft:
    """The MTP head from the mtp.* tensors the target's loader kept (then dropped there)."""
    tensors = getattr(target_model, "mtp_weights", {})
    target = target_model.config
    if not tensors:
        raise ConfigError(
            f'"method": "mtp" needs the checkpoint\'s MTP head (mtp.* tensors); this '
            f'{target.architecture} checkpoint has none. Use "ngram" or "draft_model"'
        )
    cfg = mtp_config(target, set(tensors))
    backend = select_attention(_own_config(config), cfg, device)
    head = build_on(device, torch_dtype(config), lambda: MTPHead(cfg, backend, target_model))
    load_weights(head, [(name.removeprefix("mtp."), t) for name, t in tensors.items()])
    head.finalize(device)
    if device.type == "cpu":
        lay_out_cpu_linears(head, torch_dtype(config), config.cpu_linears)
    tensors.clear()
    if hasattr(target_model, "weight_summary"):  # `kiln info`'s rows: the head's weights too
        rows = [(f"MTP head, {fmt}", n, b) for fmt, n, b in weight_summary(head)]
        target_model.weight_summary = [*target_model.weight_summary, *rows]
    experts = "with experts" if cfg.sparse_layers else "dense"
    logger.info("MTP head: one gated-attention layer (%s), sharing the target's embedding "
                "and LM head", experts)  # fmt: skip
    return LoadedDraft(cfg, backend, head.eval())


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
    trace: tuple[Path | None, str],
) -> ModelRunner:
    """`trace`: the target's compile cache entry (where the drafter's Dynamo trace is saved
    beside the target's), or why there is none."""
    own = _own_config(config)
    plan = resolve_plan(own, draft.backend, device, graph_backend, draft.config)
    sched, block_size = own.scheduler, own.cache.block_size
    width = getattr(draft.model, "hidden_input_size", 0)
    hidden = (width, torch_dtype(config)) if width else None
    buffers = InputBuffers(sched.max_num_batched_tokens, sched.max_num_seqs,
                           -(-max_model_len // block_size), block_size, device, hidden)  # fmt: skip
    sampling = Sampling(draft.config.vocab_size, tokenizer.eos_token_ids, own.seed)
    runner = ModelRunner(draft.model, draft.backend, plan, buffers, sampling, device, *trace,
                         trace_role="drafter")  # fmt: skip
    runner.pad_eager_steps = pads_eager_steps(own.eager_step_padding, device.type)
    runner.attach_graphs(graph_backend_for(plan, device, graph_backend))
    draft.runner = runner
    return runner


def draft_bytes_per_block(draft: LoadedDraft | None, config: EngineConfig) -> int:
    if draft is None:
        return 0
    return kv_bytes_per_block(draft.config, config.cache.block_size, kv_dtype(config))


def finish_draft(
    draft: LoadedDraft, config: EngineConfig, num_blocks: int, target_runner: ModelRunner
):
    """The draft runner's KV cache on the target's block count, and its proposer."""
    runner = draft.runner
    runner.allocate_kv_cache(num_blocks, torch_dtype(config), kv_dtype(config))
    generator = torch.Generator(runner.device).manual_seed(config.seed + 1)
    eos = runner.sampling.eos_token_ids
    if isinstance(draft.model, MTPHead):
        target_runner.keep_hidden = True  # the head reads every token's hidden state
        return MTPProposer(runner, eos, generator)
    return DraftModelProposer(runner, config.scheduler.max_num_batched_tokens, eos, generator)


def measure_draft_graphs(
    draft: LoadedDraft | None, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> int:
    """The drafter's graph memory, measured as the target's is: reserved before KV sizing."""
    return GraphCapture(draft.runner).measure(dtype, kv_dtype) if draft is not None else 0


def capture_draft_graphs(draft: LoadedDraft | None) -> None:
    if draft is not None:
        GraphCapture(draft.runner).capture()
