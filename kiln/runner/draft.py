"""The draft model of `"method": "draft_model"`: a second, smaller model with its own runner and
its own KV cache, on the target's block ids (the same slot holds the same position in both
caches, so it needs no block manager of its own; the boot sizes both caches from one budget).

Each round it catches up on the tokens its cache lacks (the prompt at first, then the tokens
the target kept), in chunks of the step budget, then decodes one token at a time until each
sequence has its drafts. A greedy request drafts the argmax; a sampled one draws from the draft
model's distribution shaped by the request's own parameters, and hands that distribution to
verification."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.engine.scheduler import ScheduledBatch
from kiln.engine.sequence import Sequence
from kiln.runner.model_runner import ModelRunner
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
class DraftView(SequenceView):
    """A sequence as the draft model's runner sees it: the draft cache's progress, and the
    drafts so far appended to its tokens."""

    seq: Sequence
    token_ids: list[int]
    num_computed_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: None = None
    restore_entry: int = -1
    state_slot: int = -1
    checkpoint_at: int = -1
    checkpoint_entry: int = -1

    @property
    def block_table(self) -> list[int]:
        return self.seq.block_table

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.seq.num_prompt_tokens


class RunnerProposer:
    """What a drafter with a runner of its own reports and frees."""

    runner: ModelRunner

    def warmed_up(self) -> None:
        """The boot's warm-up is over: forget its steps, count later compilations."""
        self.runner.reset_counters()
        self.runner.mark_warmed_up()

    def graph_stats(self) -> dict:
        return self.runner.graph_stats()

    def release_memory(self) -> None:
        self.runner.release_memory()


class DraftModelProposer(RunnerProposer):
    def __init__(
        self, runner: ModelRunner, budget: int, eos: frozenset[int], generator: torch.Generator
    ) -> None:
        """`runner`: the draft model's, its KV cache allocated with the target's block count;
        `budget`: tokens per catch-up forward (the step budget)."""
        self.runner, self.budget, self.eos, self.generator = runner, budget, eos, generator

    @torch.inference_mode()
    def propose(
        self, seqs: list[Sequence], counts: list[int]
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        views = [DraftView(s, list(s.token_ids), s.draft_computed) for s in seqs]
        logits = self._catch_up(views)
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        while True:
            tokens, q = draw_drafts(logits, [views[i] for i in active], self.eos, self.generator)
            for i, t, row in zip(active, tokens, q):
                drafts[i].append(t)
                if row is not None:
                    probs[i].append(row)
            active = [i for i in active if len(drafts[i]) < counts[i]]
            if not active:
                break
            logits = self._decode([views[i] for i in active], [drafts[i][-1] for i in active])
        for view, seq in zip(views, seqs):  # the drafts it fed are in its cache
            seq.draft_computed = view.num_computed_tokens
        return drafts, [torch.stack(p) if p else None for p in probs]

    def _catch_up(self, views: list[DraftView]) -> torch.Tensor:
        """Feed every view its tokens up to its last; the logits after each last token."""
        last: dict[DraftView, torch.Tensor] = {}
        pending = list(views)
        while pending:
            batch, budget = ScheduledBatch(), self.budget
            for view in pending:
                n = min(view.num_tokens - view.num_computed_tokens, budget)
                if n < 1:
                    break
                batch.seqs.append(view)  # type: ignore[arg-type]
                batch.num_tokens.append(n)
                budget -= n
            inputs, logits = self.runner.forward_logits(batch)
            for view, n in zip(batch.seqs, batch.num_tokens):
                view.num_computed_tokens += n
            for row, view in enumerate(inputs.sampling_seqs):
                last[view] = logits[row]
            pending = [v for v in pending if v.num_computed_tokens < v.num_tokens]
        return torch.stack([last[v] for v in views])

    def _decode(self, views: list[DraftView], tokens: list[int]) -> torch.Tensor:
        for view, token in zip(views, tokens):
            view.token_ids.append(token)
        batch = ScheduledBatch(list(views), [1] * len(views))  # type: ignore[arg-type]
        _, logits = self.runner.forward_logits(batch)
        for view in views:
            view.num_computed_tokens += 1
        return logits

    @staticmethod
    def ready(seq: Sequence) -> bool:
        return True

    def follow(self, seqs, starts, new_tokens, target_step) -> None:
        """Nothing to do after a target step: it catches up from the tokens when it drafts."""


def draw_drafts(
    logits: torch.Tensor, views: list[DraftView], eos: frozenset[int], generator: torch.Generator
) -> tuple[list[int], list[torch.Tensor | None]]:
    """Each view's next draft: the argmax, or a draw from its distribution shaped by the
    request's own parameters (returned too: verification's q)."""
    vocab = logits.shape[1]
    batch = SamplingBatch.build(views, vocab, logits.device)  # type: ignore[arg-type]
    shaped = shape_logits(logits, batch, eos)
    tokens = greedy_tokens(shaped)
    q: list[torch.Tensor | None] = [None] * len(views)
    rows = sampled_rows(batch)
    if rows:
        probs = sampling_probs(shaped, batch, rows)
        tokens[rows] = draw(probs, [views[i] for i in rows], generator)
        for j, i in enumerate(rows):
            q[i] = probs[j]
    return tokens.tolist(), q
