"""A request inside the engine: its prompt checked against the model and the context, its
sequences (n of them), and the output it reports after each step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.sequence import Sequence, SequenceCounter
from kiln.errors import InvalidRequestError
from kiln.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kiln.sampling_params import SamplingParams


def validate_prompt(
    ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """A prompt that cannot run is an InvalidRequestError naming the field (HTTP 400)."""
    if not ids:
        raise InvalidRequestError("the prompt is empty; send at least one token", "prompt")
    if any(not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if len(ids) >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(ids)} tokens but max_model_len is {max_model_len}: it must "
            f"be shorter by at least one token",
            "prompt",
        )
    if params.max_tokens is not None and len(ids) + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
            f"max_model_len ({max_model_len})",
            "max_tokens",
        )
    params.validate_for_vocab(vocab_size)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def output(self) -> RequestOutput:
        """Everything so far, with the text and tokens new since the last output as deltas."""
        completions = [_completion(seq) for seq in self.seqs]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            completions,
            self.finished,
            self.seqs[0].num_cached_tokens or 0,
            self.metrics,
        )


def new_sequences(
    request_id: str,
    ids: list[int],
    params: SamplingParams,
    metrics: RequestMetrics,
    tokenizer_backend: Any,
    device: torch.device,
    seq_ids: SequenceCounter,
) -> list[Sequence]:
    """The request's n sequences, each with its own detokenizer and, for a seeded request, its
    own generator; the first shares the request's metrics."""
    seqs = []
    for index in range(params.n):
        generator = None
        if params.seed is not None:
            # any int64 seed, and seed + index for the n-th completion, maps into torch's range
            generator = torch.Generator(device).manual_seed((params.seed + index) % 2**63)
        detok = IncrementalDetokenizer(
            tokenizer_backend,
            params.stop,
            params.skip_special_tokens,
            params.include_stop_str_in_output,
        )
        seq_metrics = metrics if index == 0 else RequestMetrics(metrics.arrival_time)
        seqs.append(
            Sequence(
                seq_ids.next(),
                request_id,
                index,
                list(ids),
                len(ids),
                params,
                detok,
                seq_metrics,
                generator,
            )
        )
    return seqs


def _completion(seq: Sequence) -> CompletionOutput:
    delta = seq.detokenizer.take_delta(final=seq.finished)
    new_ids = seq.output_token_ids[seq.num_reported_tokens :]
    seq.num_reported_tokens += len(new_ids)
    with_logprobs = seq.params.logprobs is not None
    return CompletionOutput(
        index=seq.index,
        text=seq.detokenizer.text[: seq.detokenizer.emitted],
        token_ids=seq.output_token_ids,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        logprobs=seq.logprobs if with_logprobs else None,
        cumulative_logprob=seq.cumulative_logprob if with_logprobs else None,
        delta_text=delta,
        delta_token_ids=new_ids,
        metrics=seq.metrics,
    )
