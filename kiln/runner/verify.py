"""Verification: the target scored each speculating sequence's last token and its k drafts in
one step; this decides which drafts it keeps and the token it adds, so that the output has the
target's distribution exactly.

Every position is shaped as the normal path shapes a token (penalties over the tokens before
it, drafts included; logit_bias; min_tokens; temperature, top-k, top-p, min-p). Greedy rows keep
the longest prefix of drafts equal to the target's argmax, then the argmax after it. Sampled
rows accept draft x with probability min(1, p(x) / q(x)) and, at the first rejection, draw from
the normalised residual max(p - q, 0): the standard speculative-sampling rule. A proposer
without a distribution (n-gram) is the case q = one-hot(x): acceptance with p(x), and the
residual is p without x."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.engine.sequence import Sequence
from kiln.runner.sampler import (
    SamplingBatch,
    SequenceView,
    draw,
    greedy_tokens,
    sampled_rows,
    sampling_probs,
    shape_logits,
)


@dataclass(eq=False)
class DraftPosition(SequenceView):
    """One position of a sequence's verification: its tokens with the drafts before this
    position appended."""

    seq: Sequence
    drafts: list[int]
    index: int  # 0 .. len(drafts): the drafts before it

    @property
    def token_ids(self) -> list[int]:
        ids = self.seq.token_ids
        return ids + self.drafts[: self.index] if self.index else ids

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + self.index


@dataclass
class Verified:
    token_ids: list[list[int]]  # per sequence: its accepted drafts, then the target's token
    first_rows: list[int]  # each sequence's first position among the logits rows
    logprobs: torch.Tensor | None  # [rows, V] raw log-softmax, when any sequence asked


def verify(
    logits: torch.Tensor,
    seqs: list[Sequence],
    drafts: list[list[int]],
    eos: frozenset[int],
    generator: torch.Generator,
    draft_probs: list[torch.Tensor | None] | None = None,
) -> Verified:
    """logits: [sum(1 + len(d)), V], each sequence's positions in order. draft_probs: per
    sequence, the proposer's shaped distributions [len(d), V] its drafts were drawn from
    (None: the drafts were picked, not drawn, as n-gram lookups are)."""
    positions = [DraftPosition(s, d, j) for s, d in zip(seqs, drafts) for j in range(len(d) + 1)]
    batch = SamplingBatch.build(positions, logits.shape[1], logits.device)  # type: ignore[arg-type]
    want_logprobs = any(s.params.logprobs is not None for s in seqs)
    raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
    shaped = shape_logits(logits, batch, eos)
    argmax = greedy_tokens(shaped).tolist()
    rows = sampled_rows(batch)
    probs = sampling_probs(shaped, batch, rows) if rows else None
    row_of_prob = {row: i for i, row in enumerate(rows)}
    first_rows, out, finals = [], [], []
    start = 0
    for i, (seq, d) in enumerate(zip(seqs, drafts)):
        first_rows.append(start)
        if seq.params.greedy:
            m = _greedy_accepted(d, argmax[start : start + len(d)])
            out.append([*d[:m], argmax[start + m]])
        else:
            p = probs[[row_of_prob[start + j] for j in range(len(d) + 1)]]
            q = draft_probs[i] if draft_probs is not None else None  # None: one-hot
            m, final = _sampled_accepted(p, d, q, seq.generator or generator)
            out.append(d[:m])
            finals.append((len(out) - 1, final, seq))
        start += len(d) + 1
    if finals:
        tokens = draw(torch.stack([f for _, f, _ in finals]), [s for *_, s in finals], generator)
        for (i, _, _), token in zip(finals, tokens.tolist()):
            out[i].append(token)
    return Verified(out, first_rows, raw_logprobs)


def _greedy_accepted(drafts: list[int], argmax: list[int]) -> int:
    m = 0
    while m < len(drafts) and drafts[m] == argmax[m]:
        m += 1
    return m


def _sampled_accepted(
    p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, generator: torch.Generator
) -> tuple[int, torch.Tensor]:
    """How many drafts survive, and the distribution the next token is drawn from. p: the
    target's [len(drafts) + 1, V]; q: the proposer's [len(drafts), V], None for one-hot."""
    k = len(drafts)
    if k == 0:
        return 0, p[0]
    ids = torch.tensor(drafts, device=p.device)
    target = p[:k].gather(1, ids[:, None]).squeeze(1)
    ratio = target if q is None else target / q[:k].gather(1, ids[:, None]).squeeze(1)
    uniform = torch.rand(k, generator=generator, device=generator.device).to(p.device)
    rejected = (uniform >= ratio).tolist()
    m = rejected.index(True) if True in rejected else k
    if m == k:
        return k, p[k]
    if q is None:
        residual = p[m].clone()
        residual[drafts[m]] = 0
    else:
        residual = (p[m] - q[m]).clamp_(min=0)
    total = residual.sum()
    # p == q leaves nothing to draw from; then the rejection had probability zero
    return m, residual / total if total > 0 else p[m]
