"""Batched sampling on the device.

Order: penalties, logit_bias, min_tokens masking, then greedy rows take the argmax; the others
divide by temperature, drop tokens outside top-k / top-p / min-p, and draw one token by the
inverse of the cumulative distribution at one uniform number (`draw`), which a seeded row takes
from its own generator: a seeded request samples the same tokens whatever else is in the
batch.
Logprobs are those of the model's raw distribution (as vLLM returns by default)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.engine.sequence import Sequence


class SequenceView:
    """A sequence as the sampler reads it, with tokens it does not hold yet (subclasses: a
    verified position with the drafts before it, a draft model's drafts so far). Subclasses
    give `seq` and their own `token_ids` and `num_output_tokens`."""

    seq: Sequence

    @property
    def params(self):
        return self.seq.params

    @property
    def generator(self) -> torch.Generator | None:
        return self.seq.generator

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B], 0 for greedy rows
    top_k: torch.Tensor | None  # [B] long, vocab size where off
    top_p: torch.Tensor | None  # [B]
    min_p: torch.Tensor | None  # [B]
    penalties: tuple[torch.Tensor, ...] | None  # repetition, presence, frequency: [B] each
    seqs: list[Sequence]

    @classmethod
    def build(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> SamplingBatch:
        ps = [s.params for s in seqs]

        def column(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        any_penalty = any(
            p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in ps
        )
        return cls(
            temperature=column([p.temperature for p in ps]),
            top_k=column([min(p.top_k or vocab_size, vocab_size) for p in ps], torch.long)
            if any(p.top_k for p in ps)
            else None,
            top_p=column([p.top_p for p in ps]) if any(p.top_p < 1 for p in ps) else None,
            min_p=column([p.min_p for p in ps]) if any(p.min_p > 0 for p in ps) else None,
            penalties=(
                column([p.repetition_penalty for p in ps]),
                column([p.presence_penalty for p in ps]),
                column([p.frequency_penalty for p in ps]),
            )
            if any_penalty
            else None,
            seqs=seqs,
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: torch.Tensor | None  # [B, V] raw log-softmax, when any row asked for logprobs


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition penalty over prompt and output (HF's rule); presence and frequency over
    output only (OpenAI's rule)."""
    rep, presence, frequency = batch.penalties
    vocab = logits.shape[1]
    seen = torch.zeros_like(logits, dtype=torch.bool)
    counts = torch.zeros_like(logits)
    for row, seq in enumerate(batch.seqs):
        ids = torch.tensor(seq.token_ids, device=logits.device, dtype=torch.long).clamp_(
            0, vocab - 1
        )
        seen[row, ids] = True
        out = ids[seq.num_prompt_tokens :]
        counts[row].index_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
    penalized = torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
    logits = torch.where(seen, penalized, logits)
    return logits - presence[:, None] * (counts > 0) - frequency[:, None] * counts


def add_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    for row, seq in enumerate(seqs):
        bias = seq.params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
            logits[row].index_add_(0, ids, values)


def min_tokens_banned(seq: Sequence, eos: frozenset[int]) -> list[int]:
    """The tokens a sequence may not sample yet: its stop tokens, and EOS unless it ignores EOS,
    while it has fewer than min_tokens outputs (none after, or with nothing to stop on)."""
    p = seq.params
    if seq.num_output_tokens >= p.min_tokens:
        return []
    return list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos))


def mask_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos: frozenset[int]) -> None:
    for row, seq in enumerate(seqs):
        banned = min_tokens_banned(seq, eos)
        if banned:
            logits[row, banned] = float("-inf")


# Top-p / min-p nuclei rarely reach past a few hundred tokens: filtering among the top
# CANDIDATES (a partial sort) and checking that the nucleus ended inside them avoids sorting
# the whole vocabulary (3.5 of a 40 ms CPU decode step for one row of SmolLM2's 49,152). A row
# whose nucleus is wider (a flat distribution at a high temperature) tries WIDE_CANDIDATES
# before the full sort.
CANDIDATES = 256
WIDE_CANDIDATES = 4096
# a nucleus with this share of its mass in the first CANDIDATES tries WIDE_CANDIDATES (random
# Gaussian logits: ends within 4096 from 0.6 for top_p 0.9, Zipf-like tails sooner)
WIDE_REACH = 0.6


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set to -inf every token outside each row's top-k, top-p nucleus and min-p floor."""
    if batch.top_k is None and batch.top_p is None and batch.min_p is None:
        return logits
    vocab = logits.shape[1]
    width = CANDIDATES
    if batch.top_k is not None:
        ks = batch.top_k[batch.top_k < vocab]
        width = max(width, int(ks.max())) if ks.numel() else width
    if width >= vocab:
        return _filter_sorted(logits, batch)
    out, covered, reach = _filter_candidates(logits, batch, width)
    if not bool(covered.all()):
        rows = (~covered).nonzero().flatten()
        out[rows] = _filter_wider(logits[rows], _rows(batch, rows), width, reach[rows])
    return out


def _filter_wider(
    logits: torch.Tensor, batch: SamplingBatch, width: int, reach: torch.Tensor
) -> torch.Tensor:
    """The rows whose filters reach past `width` candidates. Those whose top-p nucleus had
    most of its mass among them (`reach`, the head's mass over top_p) try WIDE_CANDIDATES
    where that is well below the vocabulary (0.8 against 4.3 ms a row of 49,152 on the CPU);
    the rest, and rows still uncovered, take the full sort: a flatter row would pay for both."""
    wide = reach >= WIDE_REACH
    if width >= WIDE_CANDIDATES or logits.shape[1] < 4 * WIDE_CANDIDATES or not wide.any():
        return _filter_sorted(logits, batch)
    out = logits.clone()
    rows = wide.nonzero().flatten()
    filtered, covered, _ = _filter_candidates(logits[rows], _rows(batch, rows), WIDE_CANDIDATES)
    out[rows] = filtered
    rest = torch.cat([(~wide).nonzero().flatten(), rows[~covered]])
    if rest.numel():
        out[rest] = _filter_sorted(logits[rest], _rows(batch, rest))
    return out


def _drop(sorted_logits: torch.Tensor, batch: SamplingBatch, log_total: torch.Tensor | None):
    """Which of the descending-sorted logits each filter drops. log_total: the log of each
    row's softmax denominator when the columns are only the head of the row."""
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if batch.top_k is not None:
        ranks = torch.arange(sorted_logits.shape[1], device=sorted_logits.device)
        drop |= ranks[None, :] >= batch.top_k[:, None]
    probs = None
    if batch.top_p is not None or batch.min_p is not None:
        kept = sorted_logits.masked_fill(drop, float("-inf"))
        probs = kept.softmax(-1) if log_total is None else (kept - log_total[:, None]).exp()
        if batch.top_p is not None:
            # rows at top_p 1 keep everything: a float cumsum can reach 1 before the tail
            nucleus = (probs.cumsum(-1) - probs) >= batch.top_p[:, None]
            drop |= nucleus & (batch.top_p < 1)[:, None]
        if batch.min_p is not None:
            drop |= probs < batch.min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    return drop, probs


def _filter_sorted(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop, _ = _drop(sorted_logits, batch, None)
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _filter_candidates(logits: torch.Tensor, batch: SamplingBatch, width: int):
    """Filter among each row's top `width` logits; a row is covered when its filters drop
    every token past them (then the result equals the full sort's) or it has no filter.
    Returns the filtered logits, which rows are covered, and each row's head mass over its
    top_p (0 without top_p)."""
    head, order = logits.topk(width, dim=-1)
    vocab = logits.shape[1]
    top_k = batch.top_k if batch.top_k is not None else torch.full_like(order[:, 0], vocab)
    within = top_k <= width  # the top-k survivors are all in the head
    past_k = torch.arange(width, device=head.device)[None, :] >= top_k[:, None]
    log_total = torch.where(
        within, head.masked_fill(past_k, float("-inf")).logsumexp(-1), logits.logsumexp(-1)
    )
    drop, probs = _drop(head, batch, log_total)
    covered, unfiltered = within.clone(), top_k >= vocab
    reach = torch.zeros_like(head[:, 0])
    if batch.top_p is not None:
        mass = probs.sum(-1)
        covered |= mass >= batch.top_p
        unfiltered &= batch.top_p >= 1
        reach = mass / batch.top_p
    if batch.min_p is not None:
        covered |= probs[:, -1] < batch.min_p * probs[:, 0]
        unfiltered &= batch.min_p <= 0
    out = torch.full_like(logits, float("-inf"))
    out.scatter_(1, order, head.masked_fill(drop, float("-inf")))
    out[unfiltered] = logits[unfiltered]
    return out, covered | unfiltered, reach


def _rows(batch: SamplingBatch, rows: torch.Tensor) -> SamplingBatch:
    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows]

    return SamplingBatch(
        temperature=batch.temperature[rows],
        top_k=pick(batch.top_k),
        top_p=pick(batch.top_p),
        min_p=pick(batch.min_p),
        penalties=None,
        seqs=[batch.seqs[i] for i in rows.tolist()],
    )


def _uniforms(probs: torch.Tensor, seqs: list, gen: torch.Generator) -> torch.Tensor:
    """One uniform in [0, 1) per row, float64: a seeded row's from its own generator."""
    u = torch.empty(len(seqs), device=probs.device)
    unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), generator=gen, device=probs.device)
    for i, s in enumerate(seqs):
        if s.generator is not None:
            u[i] = torch.rand(1, generator=s.generator, device=probs.device)[0]
    return u.double()


def shape_logits(logits: torch.Tensor, batch: SamplingBatch, eos: frozenset[int]) -> torch.Tensor:
    """Penalties, logit_bias and min_tokens applied to a copy of the raw logits; the raw logits
    themselves where no row has any (every caller only reads the result: a copy of 64 rows of
    SmolLM2's vocabulary was ~5 ms of a 64-stream decode step, its memory cold)."""
    seqs = batch.seqs
    if batch.penalties is None and not any(_shaped(s, eos) for s in seqs):
        return logits
    logits = apply_penalties(logits, batch) if batch.penalties is not None else logits.clone()
    add_logit_bias(logits, seqs)
    mask_min_tokens(logits, seqs, eos)
    return logits


def _shaped(seq: Sequence, eos: frozenset[int]) -> bool:
    """Whether a row's logits change: a logit_bias, or tokens min_tokens bans (min_tokens
    with ignore_eos and no stop tokens bans none, as benchmarks send it)."""
    return bool(seq.params.logit_bias) or bool(min_tokens_banned(seq, eos))


GREEDY_CHUNK = 256  # logits a chunk of greedy_tokens' first pass


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of tied maxima, NaN counted as largest, as torch.argmax).
    On the CPU, in two passes where a step has several rows: each chunk's maximum by amax (a
    vectorised reduction), then the index within the first chunk holding the row's maximum; the
    vocabulary's last partial chunk is compared on its own. PyTorch's CPU kernel for a maximum
    with its index is scalar: 2.2 ms for 64 rows of 49,152 logits, against 0.24 ms this way
    (0.35 against 0.09 at 16 rows, level at 1; a 2-core Zen 4)."""
    rows, vocab = logits.shape
    body = vocab - vocab % GREEDY_CHUNK
    if rows == 1 or body == 0 or logits.device.type != "cpu":  # a GPU's kernel is parallel
        return logits.max(-1).indices
    chunks = logits[:, :body].reshape(rows, body // GREEDY_CHUNK, GREEDY_CHUNK)
    best = chunks.amax(-1).max(-1).indices  # amax keeps NaN: then the first chunk holding one
    within = chunks[torch.arange(rows, device=logits.device), best].max(-1)
    tokens = best * GREEDY_CHUNK + within.indices
    if body == vocab:
        return tokens
    tail = logits[:, body:].max(-1)
    later = (tail.values > within.values) | (tail.values.isnan() & ~within.values.isnan())
    return torch.where(later, tail.indices + body, tokens)


def sampled_rows(batch: SamplingBatch) -> list[int]:
    return [i for i, s in enumerate(batch.seqs) if not s.params.greedy]


def sampling_probs(shaped: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> torch.Tensor:
    """The distribution each of `rows` samples from: its shaped logits over its temperature,
    outside its top-k / top-p / min-p set to zero."""
    if len(rows) == shaped.shape[0]:  # every row samples: no copy of the rows to take them
        sub, scaled = batch, shaped / batch.temperature[:, None]
    else:
        sub = _rows(batch, torch.tensor(rows, dtype=torch.long, device=shaped.device))
        scaled = shaped[rows] / sub.temperature[:, None]
    return filter_logits(scaled, sub).softmax(-1)


DRAW_BLOCK = 256  # a draw finds its block of tokens first, then the token within it


def draw(probs: torch.Tensor, seqs: list, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` (rows of any positive total), each seeded row from its
    sequence's own generator: the inverse of the row's cumulative sums at one uniform, found in
    two levels (the sums of blocks of DRAW_BLOCK tokens, then the chosen block's own), in
    float64, so that a token of probability zero (an empty interval) is never drawn. One random
    number a row, where an exponential per token (the exponential race) took 0.9 ms a row of
    the embedded model's 49,152 tokens on the CPU, and a full cumulative sum 0.06 ms."""
    rows, vocab = probs.shape
    padded = (
        torch.nn.functional.pad(probs, (0, -vocab % DRAW_BLOCK)) if vocab % DRAW_BLOCK else probs
    )
    blocks = padded.view(rows, -1, DRAW_BLOCK)
    block_cdf = blocks.sum(-1).double().cumsum(-1)
    target = (_uniforms(probs, seqs, generator) * block_cdf[:, -1]).unsqueeze(-1)
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)
    before = block_cdf.gather(1, (block - 1).clamp(min=0)) * (block > 0)  # sums before it
    inside = blocks.gather(1, block[:, :, None].expand(-1, -1, DRAW_BLOCK)).squeeze(1)
    cdf = inside.double().cumsum(-1) + before
    # the block's sum and its own cumulative sum round apart in the last bits: a target past
    # the latter takes the block's last token that can be drawn, never a zero after it
    last = torch.where(inside > 0, torch.arange(DRAW_BLOCK, device=probs.device), 0).amax(-1)
    offset = torch.minimum(torch.searchsorted(cdf, target, right=True).squeeze(-1), last)
    return block.squeeze(-1) * DRAW_BLOCK + offset


def sample(
    logits: torch.Tensor, batch: SamplingBatch, eos: frozenset[int], generator: torch.Generator
) -> SamplerOutput:
    """logits: [B, V] fp32 raw model output for the rows that sample."""
    seqs = batch.seqs
    want_logprobs = any(s.params.logprobs is not None for s in seqs)
    raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
    shaped = shape_logits(logits, batch, eos)
    rows = sampled_rows(batch)
    if not rows:
        return SamplerOutput(greedy_tokens(shaped).tolist(), raw_logprobs)
    drawn = draw(sampling_probs(shaped, batch, rows), [seqs[i] for i in rows], generator)
    if len(rows) == len(seqs):
        return SamplerOutput(drawn.tolist(), raw_logprobs)
    tokens = greedy_tokens(shaped)
    tokens[rows] = drawn
    return SamplerOutput(tokens.tolist(), raw_logprobs)
